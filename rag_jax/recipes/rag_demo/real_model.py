"""``rag-jax demo --model NAME``: the demo's retrieval feeding a pretrained chat model, zero-shot (no training).

Same data (``rag_jax.data.phantom_rag.prepare_data``), retrieval (MiniLM into a ScaNN index over the
held-out passages, ``rag_jax.evaluation.rag.retrieval_eval``, and BM25, ``bm25_eval``; ``retrieval.retriever``
= ``minilm`` or ``bm25`` feeds the answers) and report format as the default demo; the
reader is a pretrained model loaded by ``rag_jax.model.load.load_model`` (e.g. ``smollm2-135m-instruct``)
and prompted with its own chat template, greedy.

Prompt blocks (Block-Attention, Ma et al. ICLR 2025 §2.1 RAG layout: system block, one block per passage,
global last block): the chat template is rendered around one user message; the text before the message
(system turn + user tag) plus the instruction is block 0, every passage is a block, and the question
with the rest of the template (end of turn + assistant tag) is the global last block. Every block is
tokenized on its own, so full and block mode see the same ids, by the one prompt rule of ``rag_jax.text``:
the template's text is markup (its special tokens parsed), passages and the question are content (a
passage holding ``<|im_start|>`` stays text).
Without fine-tuning, block mode is expected to lose accuracy (the paper's Table 1 "w/o block fine-tuning").

Passages go best last, next to the question (``eval.passage_order=reverse``, this track's default): on
depth6_seed11 with MiniLM's top 5 that alone took retrieved answers from 0.16 to 0.26.

Answers are scored with best-subspan EM (the gold answer occurs in the reply, as Lost in the Middle; a
chat model answers in sentences) and ``answer_recall`` (fraction of a gold answer set in the reply), plus
the default demo's EM / set-F1 / token-F1; ``qa.answers`` in ``metrics.json`` has every question's replies.

Measured (SmolLM2-135M-Instruct, fp32, greedy, 50 held-out questions, one XLA thread, 2026-12-01), best-subspan
EM on ``--data ../shared/data/phantomwiki/depth6_seed11 task.num_passages=5`` (about 10 min):

    retriever   recall@5   none   top-5 full   top-5 block   gold full   gold block
    minilm      0.571      0.12   0.26         0.20          0.28        0.22
    bm25        0.823      0.12   0.28         0.16          0.30        0.18

(retrieved full vs none: 7 vs 0 discordant questions with MiniLM, 9 vs 1 with BM25; block mode is not
fine-tuned here.)
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence

from rag_jax import config as config_lib
from rag_jax.data.chat_blocks import ChatBlocks, PASSAGE
from rag_jax.data.phantom_rag import prepare_data
from rag_jax.recipes.rag_demo.config import DemoConfig
from rag_jax.recipes.rag_demo.report import check_output_dir, plots, write_report
from rag_jax.evaluation.rag import (answer_recall, bm25_eval, generate_answers, mean_scores, per_question, prompt_passages,
                                    retrieval_eval, score_answer, ttft_curve)
from rag_jax.evaluation.timing import StageTimer
from rag_jax.inference.block_attention import BlockAttention
from rag_jax.inference.kv_store import KVStore
from rag_jax.model import count_params
from rag_jax.model.load import load_model
from rag_jax.progress import progress_bar
from rag_jax.retrieval.embedders import BertEmbedder, embed_texts, minilm_dir

RETRIEVERS = ("minilm", "bm25")  # no trained GRIT embedder on this track


def run_real(cfg: DemoConfig, model_name: str, *, data_path: str | os.PathLike | None = None,
             out_dir: str | os.PathLike = "runs/demo_real", progress: bool = True, log=print) -> dict:
    """Run the real-model track and return the report (also ``metrics.json`` in ``out_dir``).

    Raises:
      PermissionError: ``out_dir`` is not writable. FileNotFoundError: the model's package, MiniLM, or
      ``data_path`` is missing. ValueError: malformed data, too few questions, a model without chat
      template, ``retrieval.retriever=grit`` (no trained model here). All before any generation.
    """

    if cfg.retrieval.retriever not in RETRIEVERS:
        raise ValueError(f"retrieval.retriever={cfg.retrieval.retriever!r}: the real-model track has no trained "
                         f"embedder; valid: {', '.join(RETRIEVERS)}")
    timer = StageTimer()
    out = check_output_dir(out_dir)
    minilm_dir()                                  # FileNotFoundError with the install hint, before compute
    log(f"[1/6] data: {'loading ' + str(data_path) if data_path else 'generating universes'}")
    data = prepare_data(cfg.universe, cfg.task, data_path)
    timer.stage("data")

    log(f"[2/6] model: {model_name} (pretrained, zero-shot; no training)")
    loaded = load_model(model_name)
    chat = ChatBlocks(loaded)
    timer.stage("model")

    log("[3/6] retrieval: MiniLM embeddings of held-out passages in a ScaNN index, and BM25; recall@k")
    minilm = BertEmbedder()
    docs = [p["text"] for p in data.eval_passages]
    questions = data.eval_questions
    queries, gold, hops = ([q[f] for q in questions] for f in ("question", "gold", "hops"))
    depth = max(max(cfg.retrieval.ks), cfg.task.num_passages + 1)
    ranked, metrics = {}, {}
    ranked["minilm"], metrics["minilm"] = retrieval_eval(
        "MiniLM-L6 (pretrained)", lambda x: embed_texts(minilm, x, desc="MiniLM passages", progress=progress),
        minilm.embed, docs, queries, gold, hops, cfg.retrieval.ks, cfg.retrieval.scann, depth)
    ranked["bm25"], metrics["bm25"] = bm25_eval(docs, queries, gold, hops, cfg.retrieval.ks, depth)
    ranked = ranked[cfg.retrieval.retriever]
    timer.stage("retrieval")

    log(f"[4/6] answering {min(cfg.eval.max_questions, len(questions))} held-out questions: no retrieval / "
        "retrieval (full, block) / gold")
    qa, ba = _answers(cfg, data, loaded, chat, ranked, progress)
    timer.stage("answers")

    log("[5/6] TTFT: full prefill vs cached passages")
    order = [int(j) for j in ranked[0] if j >= 0]
    order += [j for j in range(len(docs)) if j not in order]
    ttft = ttft_curve(ba, loaded.tokenizer, [PASSAGE.format(text=docs[j].strip()) for j in order],
                      questions[0]["question"], cfg.eval.ttft_passages, cfg.eval.ttft_repeats, progress,
                      last=chat.blocks(questions[0]["question"], [])[-1])
    timer.stage("ttft")

    log("[6/6] report")
    files = {"metrics": str(out / "metrics.json"), **plots([], ttft, out)}
    mc = loaded.config
    report = {
        "config": {**{k: config_lib.to_dict(getattr(cfg, k)) for k in ("universe", "task", "retrieval", "eval")},
                   "model": model_name},
        "data": {"source": data.source, "question_kind": data.question_kind, "train_questions": 0,
                 "eval_questions": len(questions), "train_articles": data.num_articles[0],
                 "eval_articles": data.num_articles[1], "train_passages": len(data.train_passages),
                 "eval_passages": len(data.eval_passages)},
        "model": {"name": model_name, "source": str(loaded.source), "params": count_params(mc), "base": None,
                  **{f: getattr(mc, f) for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                                 "vocab_size")}},
        "train": None,
        "retrieval": metrics,
        "qa": qa,
        "ttft": ttft,
        "files": files,
    }
    return write_report(report, timer, out, log)


def _answers(cfg: DemoConfig, data, loaded, chat: ChatBlocks, ranked, progress: bool):
    """The ``qa`` report section (as the default demo's ``_answers``) and the ``BlockAttention``."""


    k = cfg.task.num_passages
    docs = [p["text"] for p in data.eval_passages]
    questions = data.eval_questions[:cfg.eval.max_questions]
    ba = BlockAttention(loaded.model, store=KVStore(max_bytes=1 << 30), fingerprint=str(loaded.source),
                        prefix=loaded.block_prefix)
    chosen = [prompt_passages(ranked[i], q["gold"], k, cfg.eval.passage_order) for i, q in enumerate(questions)]
    prompts = {c: [chat.blocks(q["question"], [docs[j] for j in ch[c]]) for q, ch in zip(questions, chosen)]
               for c in ("retrieval", "oracle")}
    prompts["no_retrieval"] = [chat.blocks(q["question"], []) for q in questions]
    plan = [("no_retrieval", "no_retrieval", "full"), ("retrieval_full", "retrieval", "full"),
            ("retrieval_block", "retrieval", "block"), ("oracle_full", "oracle", "full"),
            ("oracle_block", "oracle", "block")]
    conditions, predictions, rows = {}, {}, {}
    for name, which, mode in progress_bar(plan, enabled=progress, desc="answering", unit="condition"):
        t0 = time.perf_counter()
        preds = generate_answers(ba, loaded.tokenizer, prompts[which], mode=mode,
                                 max_new_tokens=cfg.eval.max_new_tokens, batch_size=cfg.eval.batch_size,
                                 eos_id=loaded.eos_ids)
        rows[name] = [{**score_answer(p, q["answer"]), "answer_recall": answer_recall(p, q["answer"])}
                      for p, q in zip(preds, questions)]
        conditions[name] = {**mean_scores(rows[name]), "seconds": time.perf_counter() - t0, "mode": mode}
        predictions[name] = preds
    qa = {"num_questions": len(questions), "retriever": cfg.retrieval.retriever, "num_passages": k,
          "max_new_tokens": cfg.eval.max_new_tokens, "conditions": conditions,
          "kv_store": {"entries": len(ba.store), "bytes": ba.store.nbytes, **ba.store.stats},
          "examples": [{"question": q["question"], "gold": q["answer"],
                        **{c: predictions[c][i] for c in predictions}} for i, q in enumerate(questions[:3])],
          "answers": per_question(questions, predictions, rows)}
    return qa, ba
