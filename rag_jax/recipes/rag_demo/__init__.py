"""``rag-jax demo``: the whole framework end to end on a fictional universe, in minutes on a laptop CPU.

This module is orchestration and the report; every stage is a component of the library:

1. **Data** (``rag_jax.data.phantom_rag``): a generated PhantomWiki-style training universe and a held-out
   one, or a PhantomWiki folder (``--data``); articles cut into section passages; 1-hop attribute questions
   by default (the answer is a span of the person's article: a reader copies it, and cannot guess it).
2. **Base model and tokenizer**: the packaged reader base ``demo_reader`` (``rag_jax/assets/``, made by
   ``train/pretrain_reader.py`` on universes the demo never uses), as GritLM and Block-Attention start from
   pretrained LMs; ``base: <folder>`` takes any HF-format folder with ``tokenizer.json``; ``base: null``
   trains a BPE tokenizer and a random ``model`` from scratch (the GPU config does).
3. **Training** with the one trainer (``rag_jax.train.trainer.run``) on the GRIT + Block-Attention objective
   (``rag_jax.train.objectives.grit_block``: GritLM Eq. 3 with the Block-Attention loss as ``L_Gen``) over
   ``RagTrainingSet`` batches; the output folder is a run folder (``rag_jax.model.run_folder``).
4. **Retrieval** (``rag_jax.evaluation.rag.retrieval_eval``): held-out passages embedded with pretrained
   MiniLM and with the trained model in GRIT embedding mode, each into a ScaNN index, and a BM25 index
   (``bm25_eval``); recall@k / hit@k. ``retrieval.retriever`` picks the one that feeds the answers.
5. **Answers** to held-out questions (greedy): without retrieval; top-k retrieved passages under full
   attention; the same under Block-Attention with passage KV reuse; gold passage(s) forced into the top k.
6. **TTFT** of full prefill vs Block-Attention with warm passage caches, by prompt length.
7. **Report**: ``metrics.json``, ``loss.png``, ``ttft.png``, and the run folder files (``config.yaml``,
   ``tokenizer.json``, ``metrics.jsonl``, TensorBoard, orbax ``checkpoints/``) in the output folder.

``--model NAME`` (``rag_jax.recipes.rag_demo.real_model``) skips training: a pretrained chat model (e.g.
``smollm2-135m-instruct``) answers from the same MiniLM/ScaNN (or BM25) retrieval, zero-shot, in the same
report format.

Configuration: :class:`DemoConfig` (defaults = the CPU demo), a YAML file (``--config``, e.g.
``train/configs/demo_gpu.yaml``) and ``key=value`` overrides, loaded by ``rag_jax.config.load_config``.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from rag_jax import config as config_lib, sharding
from rag_jax.data.phantom_rag import (RagTrainingSet, answer_text, grit_format, prepare_data, question_block,
                                      rag_example)
from rag_jax.recipes.rag_demo.config import (DEFAULT_BASE, DEMO_MODEL, DEMO_OPTIMIZER, DEMO_TRAIN, DemoConfig,
                                             TokenizerConfig, load_demo_config, resolve_base)
from rag_jax.recipes.rag_demo.real_model import run_real
from rag_jax.recipes.rag_demo.report import check_output_dir, plots, write_report
from rag_jax.evaluation.rag import (bm25_eval, generate_answers, mean_scores, per_question, prompt_passages,
                                    retrieval_eval, score_answer, ttft_curve)
from rag_jax.evaluation.timing import StageTimer
from rag_jax.evaluation.models import GritSection
from rag_jax.inference.block_attention import BlockAttention
from rag_jax.inference.kv_store import KVStore
from rag_jax.model import count_params
from rag_jax.model.config import ModelConfig
from rag_jax.model.embedding import GritEmbedder
from rag_jax.model.hf import load_hf
from rag_jax.progress import progress_bar
from rag_jax.retrieval.embedders import BertEmbedder, embed_texts, minilm_dir
from rag_jax.tokenizer import BOS, EOS, PAD, load_tokenizer, train_bpe
from rag_jax.train import trainer
from rag_jax.train.checkpoint import CheckpointConfig
from rag_jax.train.objectives.block import BlockLoss
from rag_jax.train.objectives.grit import GritConfig, GritLoss
from rag_jax.train.objectives.grit_block import GritBlockLoss

__all__ = ["DemoConfig", "load_demo_config", "resolve_base", "run", "run_cli", "DEFAULT_BASE", "DEMO_MODEL",
           "DEMO_OPTIMIZER", "DEMO_TRAIN"]


def _mesh(cfg: DemoConfig):
    import jax

    devices = jax.devices()
    n = cfg.joint.devices or (1 if devices[0].platform == "cpu" else len(devices))
    if n > len(devices):
        raise ValueError(f"joint.devices={n} but only {len(devices)} devices are available")
    return sharding.make_mesh(cfg.mesh, devices=devices[:n])


def _base_model(cfg: DemoConfig, base_dir: Path | None, data, fmt):
    """``(tokenizer, model config, initial params or None)`` (module docstring, stage 2)."""
    if base_dir is None:
        # The prompt and GRIT format strings are in every input: let BPE learn them as a few tokens.
        texts = ([p["text"] for p in data.train_passages] + [q["question"] for q in data.train_questions]
                 + [question_block("") + " " + answer_text(q["answer"]) for q in data.train_questions]
                 + [fmt.embed_prefix(cfg.joint.grit_instruction), fmt.embed_prefix("")] * 8)
        tokenizer = train_bpe(texts, cfg.tokenizer.vocab_size, special_tokens=(PAD, BOS, EOS, "<unk>"))
        vocab = -(-tokenizer.get_vocab_size() // 64) * 64  # a multiple of 64: friendlier matmul shapes
        return tokenizer, cfg.model.replace(vocab_size=vocab), None
    from flax import nnx

    tokenizer = load_tokenizer(base_dir / "tokenizer.json")
    missing = [t for t in (PAD, BOS, EOS) if tokenizer.token_to_id(t) is None]
    if missing:
        raise ValueError(f"base={cfg.base!r}: tokenizer.json lacks the special tokens {missing} the demo's "
                         "prompts use")
    model_cfg, base_model, _ = load_hf(base_dir, dtype="float32")
    return tokenizer, model_cfg, nnx.split(base_model)[1]


def _train(cfg: DemoConfig, model_cfg: ModelConfig, td, tokenizer, mesh, out: Path, progress: bool, init_params):
    """Stage 3 through the one trainer; the output folder is the run folder."""
    tc = cfg.joint
    for name, size in (("rag_batch_size", tc.rag_batch_size), ("embedding_batch_size", tc.embedding_batch_size)):
        try:
            sharding.check_global_batch(size, mesh)
        except ValueError as e:
            raise ValueError(f"joint.{name}: {e}") from None
    loss_fn = GritBlockLoss(GritLoss(GritConfig(mode="embedding", temperature=tc.grit_temperature)),
                            BlockLoss(full_weight=tc.full_weight, block_weight=tc.block_weight), tc.gen_weight)
    run_cfg = trainer.RunConfig(
        model=model_cfg, mesh=cfg.mesh, optimizer=cfg.optimizer,
        train=dataclasses.replace(cfg.train, run_dir=str(out)),
        checkpoint=CheckpointConfig(save_every=cfg.train.steps, keep=1, async_save=False),
        logging=trainer.LoggingConfig(progress_bar=progress))
    task = trainer.Task(loss_fn, td.batch, name="training (GRIT + Block-Attention)", tokenizer=tokenizer,
                        progress_keys=("rep_accuracy", "gen_accuracy"))
    sections = {k: config_lib.to_dict(getattr(cfg, k)) for k in ("universe", "task", "retrieval", "eval")}
    sections["grit"] = config_lib.to_dict(GritSection(tc.grit_instruction, td.passage_max_len))  # for eval scripts
    return trainer.run(run_cfg, task, init_params=init_params, mesh=mesh, extra_config=sections)


def run(cfg: DemoConfig, *, data_path: str | os.PathLike | None = None, out_dir: str | os.PathLike = "runs/demo",
        progress: bool = True, log=print) -> dict:
    """Run the demo (module docstring) and return the report dict (also written to ``metrics.json``).

    Raises:
      PermissionError: ``out_dir`` is not writable. FileNotFoundError / ValueError: a missing or malformed
      ``data_path``, too few questions, or a missing MiniLM package while ``retrieval.retriever=minilm``.
      All are raised before any training.
    """
    timer = StageTimer()
    out = check_output_dir(out_dir)
    base_dir = resolve_base(cfg.base) if cfg.base is not None else None
    try:
        minilm_dir()
        have_minilm = True
    except FileNotFoundError:
        if cfg.retrieval.retriever == "minilm":
            raise
        have_minilm = False

    log(f"[1/7] data: {'loading ' + str(data_path) if data_path else 'generating universes'}")
    data = prepare_data(cfg.universe, cfg.task, data_path)
    timer.stage("data")

    import jax

    fmt = grit_format()
    log(f"[2/7] base model and tokenizer: {cfg.base} ({base_dir})" if base_dir else
        f"[2/7] tokenizer: byte-level BPE, vocab {cfg.tokenizer.vocab_size}; model from scratch")
    tokenizer, model_cfg, init_params = _base_model(cfg, base_dir, data, fmt)
    td = RagTrainingSet(data, tokenizer, fmt, cfg.joint, cfg.task.num_passages, cfg.train.seed)
    if td.seq_len > model_cfg.max_seq_len:
        raise ValueError(f"joint.seq_len={td.seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}; raise "
                         "model.max_seq_len or lower task.num_passages")
    timer.stage("tokenizer")

    mesh = _mesh(cfg)
    params = count_params(model_cfg)
    log(f"[3/7] training: {params / 1e6:.2f}M-param model ({'fine-tuning ' + cfg.base if cfg.base else 'from scratch'}"
        f"), {cfg.train.steps} steps, GRIT (contrastive, {cfg.joint.embedding_batch_size} queries x "
        f"{cfg.joint.group_size} passages) + Block-Attention ({cfg.joint.rag_batch_size} prompts x {td.seq_len} "
        f"tokens, full + block passes) on {mesh.size} device(s); run folder {out}")
    result = _train(cfg, model_cfg, td, tokenizer, mesh, out, progress, init_params)
    model = (result.graphdef, result.state.params)
    timer.stage("train")
    # The resolved config: the model actually trained and the data-sized lengths (config.yaml holds the same).
    resolved = dataclasses.replace(cfg, base=None, model=model_cfg, joint=dataclasses.replace(
        cfg.joint, seq_len=td.seq_len, query_max_len=td.query_max_len, passage_max_len=td.passage_max_len),
        tokenizer=TokenizerConfig(vocab_size=tokenizer.get_vocab_size()))

    log("[4/7] retrieval: embed held-out passages, ScaNN index, recall@k")
    retrieval, ranked = _retrieval(cfg, data, model, tokenizer, td, fmt, have_minilm, progress)
    timer.stage("retrieval")

    log("[5/7] answering held-out questions: no retrieval / retrieval (full, block) / gold")
    qa, ba = _answers(cfg, data, model, tokenizer, td, ranked[cfg.retrieval.retriever], progress)
    timer.stage("answers")

    log("[6/7] TTFT: full prefill vs cached passages")
    docs = [p["text"] for p in data.eval_passages]
    order = [int(j) for j in ranked[cfg.retrieval.retriever][0] if j >= 0]
    order += [j for j in range(len(docs)) if j not in order]
    ttft = ttft_curve(ba, tokenizer, [docs[j] for j in order], data.eval_questions[0]["question"],
                      cfg.eval.ttft_passages, cfg.eval.ttft_repeats, progress)
    timer.stage("ttft")

    log("[7/7] report")
    files = {"metrics": str(out / "metrics.json"), "run_folder": str(out),
             "train_metrics": str(out / "metrics.jsonl"), **plots(result.history, ttft, out)}
    report = {
        "config": config_lib.to_dict(resolved),
        "data": {"source": data.source, "question_kind": data.question_kind,
                 "train_questions": len(td.questions), "eval_questions": len(data.eval_questions),
                 "train_articles": data.num_articles[0], "eval_articles": data.num_articles[1],
                 "train_passages": len(data.train_passages), "eval_passages": len(data.eval_passages),
                 "train_questions_dropped_too_long": td.dropped},
        "model": {"params": params, "base": str(base_dir) if base_dir else None,
                  **{f: getattr(model_cfg, f) for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                                        "vocab_size")}},
        "train": {"steps": cfg.train.steps, "seconds": result.train_seconds, "compile_seconds": result.compile_seconds,
                  "seq_len": td.seq_len, "final": result.history[-1], "history": result.history},
        "retrieval": retrieval,
        "qa": qa,
        "ttft": ttft,
        "devices": f"{mesh.size} x {jax.devices()[0].device_kind}",
        "files": files,
    }
    return write_report(report, timer, out, log)


def _retrieval(cfg: DemoConfig, data, model, tokenizer, td, fmt, have_minilm: bool, progress: bool):
    """Stage 4: ``({retriever: metrics}, {retriever: ranked passage indices [q, depth]})``."""
    depth = max(max(cfg.retrieval.ks), cfg.task.num_passages + 1)
    docs = [p["text"] for p in data.eval_passages]
    queries = [q["question"] for q in data.eval_questions]
    gold = [q["gold"] for q in data.eval_questions]
    hops = [q["hops"] for q in data.eval_questions]
    embedders = {}
    if have_minilm:
        minilm = BertEmbedder()
        embedders["minilm"] = ("MiniLM-L6 (pretrained)", minilm, minilm.embed)
    grit = GritEmbedder(model, tokenizer, max_length=td.passage_max_len, fmt=fmt)
    embedders["grit"] = ("GRIT (this model)", grit,
                         lambda x: grit.embed(x, instruction=cfg.joint.grit_instruction))
    retrieval, ranked = {}, {}
    for key, (name, embed_docs, embed_queries) in embedders.items():
        ranked[key], retrieval[key] = retrieval_eval(
            name, lambda x, e=embed_docs, n=name: embed_texts(e, x, desc=f"{n} passages", progress=progress),
            embed_queries, docs, queries, gold, hops, cfg.retrieval.ks, cfg.retrieval.scann, depth)
    ranked["bm25"], retrieval["bm25"] = bm25_eval(docs, queries, gold, hops, cfg.retrieval.ks, depth)
    return retrieval, ranked


def _answers(cfg: DemoConfig, data, model, tokenizer, td, ranked, progress: bool):
    """Stage 5: the ``qa`` section of the report, and the ``BlockAttention`` (warm passage caches)."""
    import time


    k = cfg.task.num_passages
    docs = [p["text"] for p in data.eval_passages]
    questions = data.eval_questions[:cfg.eval.max_questions]
    max_new = min(cfg.eval.max_new_tokens, td.answer_tokens + 2)
    ba = BlockAttention(model, store=KVStore(max_bytes=1 << 30))
    chosen = [prompt_passages(ranked[i], q["gold"], k, cfg.eval.passage_order) for i, q in enumerate(questions)]
    prompts = {c: [rag_example(tokenizer, q["question"], [docs[j] for j in ch[c]]).blocks
                   for q, ch in zip(questions, chosen)] for c in ("retrieval", "oracle")}
    prompts["no_retrieval"] = [rag_example(tokenizer, q["question"], []).blocks for q in questions]
    conditions, predictions, rows = {}, {}, {}
    plan = [("no_retrieval", "no_retrieval", "full"), ("retrieval_full", "retrieval", "full"),
            ("retrieval_block", "retrieval", "block"), ("oracle_block", "oracle", "block")]
    for name, which, mode in progress_bar(plan, enabled=progress, desc="answering", unit="condition"):
        t0 = time.perf_counter()
        preds = generate_answers(ba, tokenizer, prompts[which], mode=mode, max_new_tokens=max_new,
                                 batch_size=cfg.eval.batch_size)
        rows[name] = [score_answer(p, q["answer"]) for p, q in zip(preds, questions)]
        conditions[name] = {**mean_scores(rows[name]), "seconds": time.perf_counter() - t0, "mode": mode}
        predictions[name] = preds
    qa = {"num_questions": len(questions), "retriever": cfg.retrieval.retriever, "num_passages": k,
          "max_new_tokens": max_new, "conditions": conditions,
          "kv_store": {"entries": len(ba.store), "bytes": ba.store.nbytes, **ba.store.stats},
          "examples": [{"question": q["question"], "gold": q["answer"],
                        **{c: predictions[c][i] for c in predictions}} for i, q in enumerate(questions[:3])],
          "answers": per_question(questions, predictions, rows)}
    return qa, ba


def run_cli(args) -> int:
    """``rag-jax demo`` (arguments defined in ``rag_jax.cli``)."""
    model = getattr(args, "model", None)
    cfg = load_demo_config(args.config, args.overrides, real_model=model is not None)
    if model is not None:
        run_real(cfg, model, data_path=args.data, out_dir=args.out or "runs/demo_real", progress=not args.no_progress)
        return 0
    run(cfg, data_path=args.data, out_dir=args.out or "runs/demo", progress=not args.no_progress)
    return 0
