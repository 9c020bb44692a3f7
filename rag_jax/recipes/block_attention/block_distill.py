"""Block-Attention fine-tuning by self-distillation on NQ-open, measured by a paired log-likelihood (issue 29).

Setting as ``block_nq`` (Lost in the Middle's NQ-open oracle file; per question its gold passage and MiniLM hard
negatives from the pool of all gold passages, none containing an answer; the model's chat template, one block per
passage): each held-out row puts the gold passage at a seeded random position among ``--num-passages``
passages, and the response is the first gold answer. The measure is the gold answer's teacher-forced
log-likelihood (nats, summed over its tokens, end of turn excluded) under full and under block attention of the
same model, paired per row: one forward, no generation, so hundreds of rows fit a CPU budget and a small
difference is visible (Wilcoxon signed-rank p and a 95% interval on the mean paired difference).

Fine-tuning (``--steps``; ``rag_jax.recipes.block_attention.distill``): training questions built the same way (with
``--train-passages`` passages), the top ``--top-layers`` layers trained to match, in block attention, the base
model's full-attention next-token distributions at every position of the question, template and answer
(``objectives.block_distill``; ``--full-weight`` also distills the full-attention pass). The answer is the first
gold answer, or with ``--targets own`` the base model's own greedy full-attention reply to the training prompt
(sequence-level distillation: the student is taught at the positions greedy decoding visits, not at a gold
string the chat model would not write; replies cached in ``--cache-dir``). Features (frozen-bottom
outputs, teacher states) are cached per row in ``--cache-dir``; the run folder ``<cache-dir>/run_<hash>`` resumes;
the tuned model is written as an HF folder ``<run>/model`` that ``--model`` accepts.

    rag-jax eval block_distill --ll-rows 100                                   # base model: the gap
    rag-jax eval block_distill --ll-rows 100 --prefix sink,system              # + training-free shared prefixes
    rag-jax eval block_distill --ll-rows 100 --train-rows 160 --train-passages 5 --steps 80 --batch-size 4 \
        --top-layers 8                                                         # the first CPU run (README row)

    rag-jax eval block_distill --ll-rows 500 --tuned smollm2-135m-instruct-block --prefix sink   # shipped model
    rag-jax eval block_distill --ll-rows 2 --attention-mass 40   # where the question block looks, full vs block

A rerun with the same arguments reuses every cached row and the finished run folder (it resumes when killed);
``--tuned`` scores an already tuned model (in the block mode its folder or delta names) instead of training;
``--em-questions N`` adds greedy answers of the first N rows in full and block modes with exact McNemar tests
(before the log-likelihood rows when nothing is trained; ``--out`` is written after them too).
"""
from __future__ import annotations

import functools
import hashlib
import json
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from rag_jax.atomic import write_text
from rag_jax.data.chat_blocks import ChatBlocks
from rag_jax.data.loaders import NQ_ORACLE, load_nq_oracle, nq_passage_pool, shared_file
from rag_jax.args import ScriptParser, input_file, integer, model_source, names, output_file, real, real_list
from rag_jax.data.loaders import heldout_split
from rag_jax.recipes.block_attention.block_nq import mine_negatives, own_reply_examples, training_examples
from rag_jax.model.transformer import REMAT_POLICIES
from rag_jax.evaluation import attention_mass
from rag_jax.evaluation.rag import generate_answers, memo_json, score_answer
from rag_jax.evaluation.stats import mcnemar, paired_difference
from rag_jax.evaluation.tables import table
from rag_jax.inference.block_attention import BlockAttention
from rag_jax.inference.block_prefix import PREFIXES
from rag_jax.inference.kv_store import model_fingerprint
from rag_jax.model.delta import apply_delta, low_rank_delta, relative_error, save_delta
from rag_jax.model.load import load_model
from rag_jax.retrieval.embedders import BertEmbedder, embed_texts
from rag_jax.retrieval.exact import ExactIndex
from rag_jax.recipes.block_attention.distill import (DistillConfig, DistillFeatures, answer_loglik, answer_logprobs, distill,
                                         export_hf, target_positions)
from rag_jax.train.frozen_bottom import split_model



def build_rows(chat, eos_id: int, examples, texts, gold_ids, questions, negatives, seed: int):
    """One ``BlockExample`` per question: its chat blocks with the gold passage at a seeded random position among
    all its ``negatives``, response = first gold answer + ``eos_id`` (``block_nq.training_examples`` with no
    length limit)."""

    rows, _ = training_examples(chat, eos_id, examples, texts, gold_ids, questions, negatives, 1 << 30, seed)
    return rows


def main(argv=None) -> int:

    d = DistillConfig()
    p = ScriptParser(prog="rag-jax eval block_distill", description=__doc__)
    p.add_argument("--model", type=model_source, default="smollm2-135m-instruct",
                   help="embedded name, .gguf file or HF folder (tied embeddings)")
    p.add_argument("--data", type=input_file, default=str(shared_file(*NQ_ORACLE)))
    p.add_argument("--heldout", type=real(0, 1, lo_open=True, hi_open=True), default=0.2,
                   help="fraction of the questions held out (block_nq's split)")
    p.add_argument("--seed", type=integer(0), default=0, help="split seed (the rows' gold positions: seed + 1)")
    p.add_argument("--num-passages", type=integer(1), default=10, help="passages per held-out row")
    p.add_argument("--ll-rows", type=integer(2), default=200, help="held-out rows of the log-likelihood table")
    p.add_argument("--train-rows", type=integer(1), default=400)
    p.add_argument("--train-passages", type=integer(1), default=None, help="passages per training row "
                   "(default --num-passages)")
    p.add_argument("--train-max-passage", type=integer(16), default=None,
                   help="drop training rows with a passage longer than this many tokens: the block pass pads "
                        "every passage to the longest one (NQ: mean 127, max 457 tokens; 256 halves the padded slots)")
    p.add_argument("--targets", choices=("gold", "own"), default="gold",
                   help="training responses: the first gold answer, or the base model's own greedy full-attention "
                        "reply (the positions greedy decoding visits; rows whose reply is cut at --target-tokens "
                        "are dropped; replies cached in --cache-dir)")
    p.add_argument("--target-tokens", type=integer(1), default=48, help="with --targets own: reply cap (tokens)")
    p.add_argument("--keep-cut", action="store_true",
                   help="with --targets own: keep replies cut at --target-tokens (trained without an end of turn) "
                        "instead of dropping their rows")
    p.add_argument("--top-layers", type=integer(1), default=d.top_layers)
    p.add_argument("--steps", type=integer(0), default=0, help="distillation steps; 0 = base model only")
    p.add_argument("--batch-size", type=integer(1), default=d.batch_size, help="rows per step")
    p.add_argument("--lr", type=real(0, lo_open=True), default=d.learning_rate)
    p.add_argument("--warmup", type=integer(0), default=d.warmup_steps)
    p.add_argument("--full-weight", type=real(0), default=d.full_weight,
                   help="weight of the full-attention pass's KL (0 = block pass only)")
    p.add_argument("--remat", choices=REMAT_POLICIES, default=d.remat_policy,
                   help="rematerialization of the trained top (dots / full: less memory for a deep top, more compute)")
    p.add_argument("--lora-rank", type=integer(0), default=d.lora_rank,
                   help="train rank-R LoRA adapters (flax nnx.LoRA) on every projection of the top layers instead of "
                        "their weights (frozen weights: no weight gradients or optimizer state); 0 = the weights")
    p.add_argument("--length-buckets", action="store_true",
                   help="train on batches of rows of similar lengths, each padded to its own widths (one compiled "
                        "step per shape) instead of one shape for all rows (DistillConfig.length_buckets)")
    p.add_argument("--flat-block-pass", action="store_true",
                   help="with --train-prefix none: the block pass as one block-masked forward over each row (no "
                        "per-passage padding) instead of passages padded to a grid (DistillConfig.flat_block_pass)")
    p.add_argument("--seq-len", type=integer(16), default=None, help="training row length (default: longest row)")
    p.add_argument("--prefix", type=names(PREFIXES[1:]), default=[],
                   help="training-free rows, comma-separated: sink (every passage block sees block 0's first token), "
                        "system (every passage block sees all of block 0), nosink (each passage's first token hidden "
                        "from the question); rag_jax.inference.block_prefix")
    p.add_argument("--passage-temperature", type=real_list(0, lo_open=True), default=[],
                   help="training-free EM rows (with --em-questions), comma-separated T values: block mode of the base "
                        "model (each --prefix too) with attention logits to passage tokens divided by T (APE's "
                        "temperature; BlockAttention(passage_temperature=T)); not in the log-likelihood table")
    p.add_argument("--train-prefix", choices=PREFIXES[:3], default=d.prefix,
                   help="the block mode the model is distilled in and evaluated with (none = plain block mode)")
    p.add_argument("--delta-rank", type=integer(0), default=32,
                   help="also write the tuned model as a rank-R bfloat16 delta <run>/delta.safetensors (--model "
                        "accepts it) and score it; 0 = off")
    p.add_argument("--tuned", type=model_source, default=None,
                   help="score an already tuned model instead of training one (run folder <run>/model, delta file "
                        "or embedded name such as smollm2-135m-instruct-block), in the block mode it names; its "
                        "bottom layers (all but --top-layers) must equal the base's")
    p.add_argument("--em-questions", type=integer(0), default=0,
                   help="the first N held-out rows also answered greedily (best-subspan EM, exact McNemar vs full "
                        "attention of the base model); 0 = off")
    p.add_argument("--attention-mass", type=integer(0), default=0,
                   help="held-out rows of the attention-mass diagnostic: per layer, the question block's attention "
                        "on the instruction, the gold passage, the other passages and itself, full vs block mode")
    p.add_argument("--max-new-tokens", type=integer(1), default=24)
    p.add_argument("--em-batch-size", type=integer(1), default=8)
    p.add_argument("--cache-dir", type=Path, default=Path("runs/block_distill"),
                   help="MiniLM pool embeddings, per-row features and the run folders")
    p.add_argument("--out", type=output_file, default=None, help="JSON results")
    args = p.parse_args(argv)
    train_passages = args.train_passages or args.num_passages


    wall = time.perf_counter()
    examples = load_nq_oracle(args.data)
    pool, gold_ids = nq_passage_pool(examples)
    train, heldout = heldout_split(len(examples), args.heldout, args.seed)
    if args.ll_rows > len(heldout):
        p.error(f"argument --ll-rows: {args.ll_rows} exceeds the {len(heldout)} held-out questions")
    if args.em_questions > len(heldout):
        p.error(f"argument --em-questions: {args.em_questions} exceeds the {len(heldout)} held-out questions")
    if args.flat_block_pass and args.train_prefix != "none":
        p.error(f"argument --flat-block-pass: needs --train-prefix none (got {args.train_prefix}): a shared prefix is "
                "encoded before every passage, which one forward over the row does not do")
    if args.tuned is not None and args.steps:
        p.error(f"argument --tuned: {args.tuned} is scored instead of training; drop --steps {args.steps}")
    loaded = load_model(args.model)
    tuned_loaded = None if args.tuned is None else load_model(args.tuned)
    tuned_prefix = args.train_prefix if tuned_loaded is None else tuned_loaded.block_prefix
    if not args.top_layers < loaded.config.num_layers:
        p.error(f"argument --top-layers: {args.top_layers} must be below the model's {loaded.config.num_layers} "
                "layers (the bottom stays frozen)")
    if tuned_loaded is not None:
        problem = same_bottom(loaded.model, tuned_loaded.model, args.top_layers)
        if problem:
            p.error(f"argument --tuned: {args.tuned} {problem}")
    if not loaded.config.tie_embeddings:
        p.error(f"argument --model: {args.model} has an untied output head; distillation reads the teacher's "
                "logits through the frozen tied embedding")
    heldout = heldout[:max(args.ll_rows, args.em_questions, args.attention_mass)]  # rows are prefix-stable: the first N are the same
    train_q = np.random.default_rng(args.seed).permutation(train)[:args.train_rows].tolist() if args.steps else []
    texts = [f"(Title: {x.title}) {x.text}" for x in pool]
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    pool_cache = args.cache_dir / f"minilm_pool_{hashlib.sha1(str(args.data).encode()).hexdigest()[:8]}.npz"
    emb = BertEmbedder()
    if pool_cache.is_file():
        p_vecs = np.load(pool_cache)["passages"]
    else:
        p_vecs = embed_texts(emb, [f"{x.title}\n{x.text}" for x in pool], desc="MiniLM pool")
        np.savez(pool_cache, passages=p_vecs)
    index = ExactIndex(p_vecs.shape[1])
    index.add(p_vecs, np.arange(len(pool)))

    chat, eos = ChatBlocks(loaded), loaded.eos_ids[0]
    heldout_rows = build_rows(chat, eos, examples, texts, gold_ids, heldout,
                              mine_negatives(emb, index, pool, examples, gold_ids, heldout, args.num_passages - 1),
                              args.seed + 1)
    eval_rows = heldout_rows[:args.ll_rows]                   # the log-likelihood rows
    @functools.cache  # one object per prefix: rows computed or loaded once are reused in memory
    def features_for(prefix):
        return DistillFeatures(loaded.model, args.top_layers, prefix=prefix, cache_dir=args.cache_dir / "features")

    tuned_mode = "block" if tuned_prefix == "none" else f"block + {tuned_prefix} prefix"
    models = {"base": loaded.model, **({} if tuned_loaded is None else {"tuned": tuned_loaded.model})}
    info: dict = {}

    def write_out(results=None):
        if args.out is not None:
            write_text(args.out, json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **info,
                                             "results": results}, indent=1, default=float))

    def run_em():
        base_prefixes = list(dict.fromkeys(["none", *args.prefix]))       # --prefix: training-free rows
        base_rows = [(q, 1.0) for q in base_prefixes] + [(q, t) for t in args.passage_temperature for q in base_prefixes]
        info["em"] = em_table(loaded, {name: (m, base_rows if name == "base" else [(tuned_prefix, 1.0)])
                                       for name, m in models.items()},
                              examples, heldout[:args.em_questions], heldout_rows[:args.em_questions], args)
        write_out()                                           # kept if the log-likelihood rows are cut short

    if args.attention_mass:
        info["attention_mass"] = mass_table(models, heldout_rows[:args.attention_mass],
                                            [gold_block(chat, r, texts[gold_ids[q]]) for r, q in zip(heldout_rows, heldout)])
        write_out()
    if args.em_questions and not args.steps:
        run_em()                                              # its models need no features: answers first
    plain = features_for("none").compute(eval_rows, desc="features (held-out rows)")
    logp = {"full (base)": [f["logp_full"] for f in plain], "block (base)": [f["logp_block"] for f in plain]}
    scored = args.steps or tuned_loaded is not None
    for name in dict.fromkeys(args.prefix + ([tuned_prefix] if scored and tuned_prefix != "none" else [])):
        rows = features_for(name).compute(eval_rows, desc=f"features (held-out rows, {name} prefix)")
        logp[f"block + {name} prefix (base)"] = [f["logp_block"] for f in rows]
    if args.steps:
        train_rows = build_rows(chat, eos, examples, texts, gold_ids, train_q,
                                mine_negatives(emb, index, pool, examples, gold_ids, train_q, train_passages - 1),
                                args.seed + 2)
        if args.train_max_passage:
            kept = [r for r in train_rows if max(map(len, r.blocks[1:-1]), default=0) <= args.train_max_passage]
            print(f"training rows: {len(kept)} of {len(train_rows)} have no passage over {args.train_max_passage} "
                  "tokens", flush=True)
            if not kept:
                p.error(f"argument --train-max-passage: no training row has every passage within "
                        f"{args.train_max_passage} tokens")
            train_rows = kept
        if args.targets == "own":
            train_rows = own_reply_examples(loaded, train_rows, model_key=str(args.model),
                                            max_tokens=args.target_tokens, batch_size=args.em_batch_size,
                                            cache=args.cache_dir / "own_replies.json", keep_cut=args.keep_cut)
        seq_len = args.seq_len or max(r.num_tokens for r in train_rows)
        features = features_for(args.train_prefix)
        feats = features.compute(eval_rows, desc="features (held-out rows)")
        cfg = DistillConfig(top_layers=args.top_layers, steps=args.steps, batch_size=args.batch_size,
                            prefix=args.train_prefix,
                            seq_len=-(-seq_len // 64) * 64,
                            max_targets=-(-max(len(target_positions(r)[0]) for r in train_rows) // 16) * 16,
                            full_weight=args.full_weight, learning_rate=args.lr, warmup_steps=args.warmup,
                            seed=args.seed, save_every=max(1, min(25, args.steps)), remat_policy=args.remat,
                            lora_rank=args.lora_rank, length_buckets=args.length_buckets,
                            flat_block_pass=args.flat_block_pass)
        recipe = {"model": str(args.model), "data": str(args.data), "heldout": args.heldout, "seed": args.seed,
                  "train_rows": args.train_rows, "train_passages": train_passages, **cfg.record(),
                  **({"train_max_passage": args.train_max_passage} if args.train_max_passage else {}),
                  **({"targets": "own", "target_tokens": args.target_tokens} if args.targets == "own" else {}),
                  **({"keep_cut": True} if args.keep_cut else {})}
        run_dir = args.cache_dir / f"run_{hashlib.sha1(json.dumps(recipe).encode()).hexdigest()[:10]}"
        print(f"distillation: {len(train_rows)} rows, {np.mean([len(r.blocks) - 2 for r in train_rows]):.1f} "
              f"passages and {np.mean([r.num_tokens for r in train_rows]):.0f} tokens per row; {cfg}; {run_dir}",
              flush=True)
        t0, c0 = time.perf_counter(), time.process_time()
        tuned, result = distill(loaded, train_rows, cfg, run_dir, features=features,
                                extra_config={"block_distill": recipe})
        info["distill"] = {"run_dir": str(run_dir), "steps": result.step, "train_seconds": result.train_seconds,
                           "wall_seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
                           "history": result.history}
        models["distilled"] = tuned
        top = split_model(tuned, args.top_layers)[1]
        logp[f"{tuned_mode} (distilled)"] = answer_logprobs(top, eval_rows, feats, "block")
        logp["full (distilled)"] = answer_logprobs(top, eval_rows, feats, "full")
        export_hf(loaded, tuned, run_dir / "model", prefix=args.train_prefix)
        print(f"tuned model: {run_dir / 'model'} (--model accepts it)", flush=True)
        if args.delta_rank:
            delta = low_rank_delta(loaded.model, tuned, args.delta_rank)
            path = save_delta(run_dir / "delta.safetensors", delta,
                              {"base": str(args.model), "block_prefix": args.train_prefix})
            err = relative_error(loaded.model, tuned, delta)
            info["delta"] = {"path": str(path), "bytes": path.stat().st_size, "rank": args.delta_rank,
                             "max_relative_error": max(err.values()), "mean_relative_error": float(np.mean(
                                 list(err.values())))}
            print(f"delta: {path} ({path.stat().st_size / 1e6:.1f} MB, rank {args.delta_rank}, relative error "
                  f"mean {info['delta']['mean_relative_error']:.3f} max {info['delta']['max_relative_error']:.3f})",
                  flush=True)
            with_delta = split_model(apply_delta(loaded.model, path), args.top_layers)[1]
            logp[f"{tuned_mode} (delta r{args.delta_rank})"] = answer_logprobs(with_delta, eval_rows, feats, "block")
            logp[f"full (delta r{args.delta_rank})"] = answer_logprobs(with_delta, eval_rows, feats, "full")

    if tuned_loaded is not None:                              # its own features: cached per row, as the base's
        tuned_rows = DistillFeatures(tuned_loaded.model, args.top_layers, prefix=tuned_prefix,
                                     cache_dir=args.cache_dir / "features").compute(
            eval_rows, desc="features (held-out rows, tuned model)")
        logp[f"{tuned_mode} (tuned)"] = [f["logp_block"] for f in tuned_rows]
        logp["full (tuned)"] = [f["logp_full"] for f in tuned_rows]
    ll = {name: answer_loglik(eval_rows, lp) for name, lp in logp.items()}
    base_gap = ll["full (base)"] - ll["block (base)"]
    rows, results = [], {}
    for name, x in ll.items():
        diff = paired_difference(x, ll["full (base)"]) if name != "full (base)" else None
        closed = (float(np.mean(x - ll["block (base)"]) / np.mean(base_gap))
                  if name.startswith("block") and name != "block (base)" else None)
        results[name] = {"loglik_mean": float(x.mean()), "vs_full_base": diff, "gap_closed": closed,
                         "loglik": x.tolist()}
        rows.append([name, f"{x.mean():.3f}",
                     "" if diff is None else f"{diff['mean']:+.3f} [{diff['ci_low']:+.3f}, {diff['ci_high']:+.3f}]",
                     "" if diff is None else f"{diff['p']:.2g}", "" if closed is None else f"{closed:.0%}"])
    print(f"# {args.model}, NQ-open held-out: {len(eval_rows)} rows of {args.num_passages} passages (gold at a seeded "
          f"random position among MiniLM hard negatives); gold-answer log-likelihood (nats)")
    print(table(["inference", "mean LL", "vs full (base) [95% CI]", "Wilcoxon p", "gap closed"], rows))
    if args.em_questions and args.steps:
        run_em()
    info["wall_seconds"] = time.perf_counter() - wall
    write_out(results)
    return 0


def gold_block(chat, row, text: str) -> int:
    """Index of the passage block holding ``text`` in ``row.blocks``."""
    return row.blocks.index(tuple(chat.blocks("", [text])[1]))


def mass_table(models: dict, rows, golds) -> dict:
    """``attention_mass`` per model and mode, averaged over ``rows``: prints the mean per category over the bottom,
    middle and top third of the layers, for whole blocks and for each block's first token (where a block encoded
    alone grows a sink); returns ``{"<mode> (<model>)": {category: per-layer list}}``."""
    out, lines = {}, []
    for name, model in models.items():
        for mode in attention_mass.MODES:
            cats = {}
            for lead, suffix in ((None, ""), (1, ", first token")):
                per_row = [attention_mass.categorize(attention_mass.block_attention_mass(model, r.blocks, mode, lead), g)
                           for r, g in zip(rows, golds)]
                cats |= {c + suffix: np.mean([x[c] for x in per_row], axis=0) for c in attention_mass.CATEGORIES}
            out[f"{mode} ({name})"] = {c: v.tolist() for c, v in cats.items()}
            thirds = np.array_split(np.arange(len(cats["question"])), 3)
            lines += [[f"{mode} ({name})", c, *[f"{v[t].mean():.3f}" for t in thirds]] for c, v in cats.items()]
    print(f"# attention mass of the question block's tokens (mean over {len(rows)} held-out rows, tokens and heads)")
    print(table(["inference", "keys", "bottom third", "middle third", "top third"], lines))
    return out


def same_bottom(base, tuned, top_layers: int) -> str | None:
    """None when ``tuned`` has ``base``'s configuration and its bottom (all but the top ``top_layers`` layers,
    embedding included) holds bit-identical weights, so the base's cached bottom outputs serve it; else what
    differs, as a sentence fragment."""

    if tuned.config != base.config:
        return "has another configuration than --model"
    b, t = (nnx.state(split_model(m, top_layers)[0], nnx.Param) for m in (base, tuned))
    b, t = (jax.tree_util.tree_leaves_with_path({"embedding": x["embedding"], "layers": x["layers"]})
            for x in (b, t))                                  # the bottom's final norm is not used by it
    changed = [jax.tree_util.keystr(k) for (k, x), (_, y) in zip(b, t)
               if not np.array_equal(np.asarray(x), np.asarray(y))]
    return f"changes {changed[0]} below the top {top_layers} layers (raise --top-layers)" if changed else None


def _condition(name: str, mode: str, prefix: str, t: float) -> str:
    """A row label of ``em_table``: ``block + sink prefix, T=0.8 (base)``."""
    label = mode if prefix == "none" else f"block + {prefix} prefix"
    return f"{label}{f', T={t:g}' if t != 1.0 else ''} ({name})"


def em_table(loaded, models: dict, examples, questions, rows, args) -> dict:
    """Greedy answers to ``rows`` (their blocks) of each model of ``models`` (``{name: (model, [(prefix, T)])}``) in
    full attention and in block attention with each of its prefixes and passage temperatures ``T``
    (``BlockAttention``'s ``passage_temperature``), best-subspan EM per question, printed with
    the exact McNemar test against full attention of the ``"base"`` model; returns ``{condition: {"em",
    "only_this", "only_full_base", "p", "correct", "replies"}}`` (``replies``: the greedy answer strings). Replies are kept in
    ``<args.cache_dir>/em_replies.json``, keyed by a hash of the model's weights, the mode, the prompt and the
    decoding settings, and stored every 8 batches: a rerun, or another run sharing a model and condition, generates
    nothing again, and a run cut short keeps what it answered."""

    prompts = [[list(map(int, b)) for b in r.blocks] for r in rows]
    eos = tuple(loaded.eos_ids)
    fingerprints = {name: model_fingerprint(model, model.config) for name, (model, _) in models.items()}
    conds = [(name, mode, prefix, t) for name, (_, prefixes) in models.items()
             for mode, prefix, t in [("full", "none", 1.0)] + [("block", p, t) for p, t in prefixes]]
    # Answered first: the reference, then the block modes (tuned models first: the claim), then full attention of
    # tuned models; each condition's replies are cached once complete, so a run cut short keeps those that matter.
    first = sorted(conds, key=lambda c: (c != ("base", "full", "none", 1.0), c[1] == "full", c[0] == "base"))
    correct, replies = {}, {}
    for name, mode, prefix, t in first:
        model = models[name][0]
        cond = _condition(name, mode, prefix, t)
        t0 = time.perf_counter()
        keys = [hashlib.sha256(json.dumps([fingerprints[name], mode, prefix, args.max_new_tokens, list(map(int, eos)),
                                           b] + ([t] if t != 1.0 else [])).encode()).hexdigest() for b in prompts]
        by_key = dict(zip(keys, prompts))
        preds = memo_json(args.cache_dir / "em_replies.json", keys, lambda todo: generate_answers(
            BlockAttention(model, prefix=prefix, passage_temperature=t), loaded.tokenizer, [by_key[k] for k in todo],
            mode=mode,
            max_new_tokens=args.max_new_tokens, batch_size=args.em_batch_size, eos_id=eos),
            chunk=8 * args.em_batch_size)
        correct[cond] = [bool(score_answer(pr, examples[i].answers, golds_are_set=False)["subspan_em"])
                         for pr, i in zip(preds, questions)]
        replies[cond] = list(preds)
        print(f"  {cond}: EM {np.mean(correct[cond]):.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    out, table_rows = {}, []
    for name, mode, prefix, t in conds:                       # the table in the models' order
        cond = _condition(name, mode, prefix, t)
        c = correct[cond]
        only, only_base, pval = mcnemar(c, correct["full (base)"])
        out[cond] = {"em": float(np.mean(c)), "only_this": only, "only_full_base": only_base, "p": pval,
                     "correct": c, "replies": replies[cond]}
        table_rows.append([cond, f"{np.mean(c):.3f}", "" if cond == "full (base)" else f"{only} vs {only_base}",
                           "" if cond == "full (base)" else f"{pval:.2g}"])
    print(f"# best-subspan EM, {len(rows)} held-out questions (gold at a seeded random position)")
    print(table(["inference", "EM", "discordant vs full (base)", "McNemar p"], table_rows))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
