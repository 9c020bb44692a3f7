"""Retrieval-augmented QA with a ``rag-jax demo`` checkpoint: PhantomWiki folders and the NQ-open oracle.

Metrics (``rag_jax.metrics`` via ``rag_jax.demo.score_answer``; research note retrieval_eval.md §2):
SQuAD-normalized exact match (EM), token F1, best-subspan EM (gold is a substring of the prediction,
Lost in the Middle) and PhantomWiki's set EM / set-F1 (split on commas, lowercase, compare as sets).

- PhantomWiki folder (``articles.json`` + ``questions.json``): the questions the demo would hold out
  (same selection, section passages and seeded split as ``rag-jax demo --data``; ``--split all``
  scores every selected question). Conditions: no retrieval; the top-k passages of a ScaNN index
  (MiniLM or the checkpoint in GRIT embedding mode) under full attention and under Block-Attention
  with KV reuse; the gold passage(s) forced into the top k. For answer sets the SQuAD metrics compare against the
  comma-joined set.
- NQ-open oracle (``nq-open-oracle.jsonl.gz``, Liu et al. 2024): each question with its gold passage
  (oracle context; full and block attention) and without context. Answers are alternatives: every
  metric is the best over them. Passages longer than the model's window are truncated.

A demo model trained on a fictional universe is not expected to answer NQ; the NQ rows show the
pipeline and the metrics on real data (a checkpoint trained with ``--config`` at scale would).

    python eval/rag_qa.py --checkpoint runs/demo/checkpoint --data ../shared/data/phantomwiki/depth6_seed11
    python eval/rag_qa.py --checkpoint runs/demo/checkpoint \\
        --data ../shared/data/lost_in_the_middle/nq-open-oracle.jsonl.gz --limit 200
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rag_jax import demo  # noqa: E402

METRICS = ("em", "f1", "subspan_em", "set_em", "set_f1")


def _score(preds: list[str], golds: list[list[str]], golds_are_set: bool) -> dict:
    rows = [demo.score_answer(p, g, golds_are_set=golds_are_set) for p, g in zip(preds, golds)]
    return {m: float(np.mean([r[m] for r in rows])) for m in METRICS}


def _fit(blocks: list[list[int]], max_len: int) -> list[list[int]]:
    """Truncate the passage blocks (not the question block) so the prompt fits ``max_len`` tokens."""
    room = max_len - len(blocks[-1])
    out = []
    for b in blocks[:-1]:
        if room <= 0:
            break
        out.append(list(b[:room]))
        room -= len(out[-1])
    return out + [list(blocks[-1])]


def eval_phantomwiki(args, cfg, model, tokenizer) -> tuple[dict, list[dict]]:
    import dataclasses

    from rag_jax.inference.block_attention import BlockAttention
    from rag_jax.inference.kv_store import KVStore
    from rag_jax.model.embedding import GritEmbedder
    from rag_jax.retrieval.embedders import BertEmbedder

    task = dataclasses.replace(cfg.task, **{k: v for k, v in (("questions", args.questions),
                                                               ("max_hops", args.max_hops)) if v is not None})
    data = demo.prepare_data(dataclasses.replace(cfg, task=task), args.data)
    questions = data.eval_questions if args.split == "heldout" else data.eval_questions + data.train_questions
    questions = questions[:args.limit] if args.limit else questions
    k = task.num_passages
    if args.retriever == "minilm":
        emb = BertEmbedder()
        embed_docs = embed_queries = emb.embed
    else:
        grit = GritEmbedder(model, tokenizer, max_length=cfg.train.passage_max_len or 256, fmt=demo.grit_format())
        embed_docs = grit.embed
        embed_queries = lambda x: grit.embed(x, instruction=cfg.train.grit_instruction)  # noqa: E731
    docs = [p["text"] for p in data.eval_passages]
    ranked, recall = demo.retrieval_eval(args.retriever, embed_docs, embed_queries, docs,
                                         [q["question"] for q in questions], [q["gold"] for q in questions],
                                         [q["hops"] for q in questions], (1, k, 5), cfg.retrieval.scann, k + 1)
    prompts = {
        "no retrieval": [demo.rag_example(tokenizer, q["question"], []).blocks for q in questions],
        "retrieval": [demo.rag_example(tokenizer, q["question"], [docs[j] for j in r[:k] if j >= 0]).blocks
                      for q, r in zip(questions, ranked)],
        "gold": [demo.rag_example(tokenizer, q["question"], [docs[j] for j in demo.with_gold(r, q["gold"], k)]).blocks
                 for q, r in zip(questions, ranked)],
    }
    ba = BlockAttention(model, store=KVStore(max_bytes=1 << 30))
    golds = [q["answer"] for q in questions]
    results, examples = {}, []
    for label, which, mode in (("no retrieval", "no retrieval", "full"),
                               (f"retrieved top-{k} ({args.retriever}), full", "retrieval", "full"),
                               (f"retrieved top-{k} ({args.retriever}), block", "retrieval", "block"),
                               (f"gold in top-{k}, block", "gold", "block")):
        t0 = time.perf_counter()
        preds = demo.generate_answers(ba, tokenizer, prompts[which], mode=mode, max_new_tokens=args.max_new_tokens,
                                      batch_size=args.batch_size)
        results[label] = {**_score(preds, golds, True), "seconds": time.perf_counter() - t0}
        examples.append({label: preds[:5]})
    info = {"dataset": str(args.data), "questions": len(questions), "question_kind": data.question_kind,
            "split": args.split, "retrieval": {kk: v for kk, v in recall.items() if kk != "by_hops"},
            "kv_store": {"entries": len(ba.store), **ba.store.stats}}
    return {"info": info, "results": results}, examples


def eval_nq(args, cfg, model, tokenizer) -> tuple[dict, list[dict]]:
    from rag_jax.data.block_rag import encode
    from rag_jax.data.loaders import load_nq_oracle
    from rag_jax.inference.block_attention import BlockAttention
    from rag_jax.inference.kv_store import KVStore

    examples = load_nq_oracle(args.data, limit=args.limit or None)
    max_len = cfg.model.max_seq_len - args.max_new_tokens
    ba = BlockAttention(model, store=KVStore(max_bytes=1 << 30))
    closed, oracle = [], []
    for ex in examples:
        last = encode(tokenizer, demo.question_block(ex.question))
        closed.append([last])
        oracle.append(_fit([encode(tokenizer, demo.passage_text(ex.gold.title, ex.gold.text)), last], max_len))
    golds = [list(ex.answers) for ex in examples]
    results, shown = {}, []
    for label, prompts, mode in (("no context", closed, "full"), ("gold passage, full", oracle, "full"),
                                 ("gold passage, block", oracle, "block")):
        t0 = time.perf_counter()
        preds = demo.generate_answers(ba, tokenizer, prompts, mode=mode, max_new_tokens=args.max_new_tokens,
                                      batch_size=args.batch_size)
        results[label] = {**_score(preds, golds, False), "seconds": time.perf_counter() - t0}
        shown.append({label: preds[:5]})
    info = {"dataset": str(args.data), "questions": len(examples)}
    return {"info": info, "results": results}, shown


def print_table(report: dict) -> None:
    info = report["info"]
    print(f"# {info['dataset']}: {info['questions']} questions"
          + (f" ({info['question_kind']}, {info['split']})" if "split" in info else ""))
    if "retrieval" in info:
        print("# retrieval: " + ", ".join(f"{k}={v:.3f}" for k, v in info["retrieval"].items()
                                          if k.startswith(("recall", "hit"))))
    print("| condition | " + " | ".join(METRICS) + " | seconds |")
    print("|---|" + "---:|" * (len(METRICS) + 1))
    for name, r in report["results"].items():
        print(f"| {name} | " + " | ".join(f"{r[m]:.3f}" for m in METRICS) + f" | {r['seconds']:.1f} |")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=Path, help="a demo checkpoint folder (<out>/checkpoint)")
    p.add_argument("--data", required=True, type=Path,
                   help="PhantomWiki folder, or an NQ-open oracle .jsonl(.gz) file")
    p.add_argument("--limit", type=int, default=200, help="at most this many questions (0 = all)")
    p.add_argument("--split", choices=("heldout", "all"), default="heldout",
                   help="PhantomWiki: the demo's held-out questions, or all selected ones")
    p.add_argument("--questions", choices=demo.QUESTION_KINDS, default=None,
                   help="PhantomWiki question selection (default: the checkpoint's task.questions)")
    p.add_argument("--max-hops", type=int, default=None, help="PhantomWiki: at most this many hops")
    p.add_argument("--retriever", choices=demo.RETRIEVERS, default=None,
                   help="PhantomWiki retriever (default: the checkpoint's retrieval.retriever)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--out", type=Path, default=None, help="JSON output (default: runs/eval/rag_qa_<data>.json)")
    args = p.parse_args(argv)
    if args.limit < 0 or args.max_new_tokens < 1 or args.batch_size < 1:
        p.error("--limit must be >= 0, --max-new-tokens and --batch-size >= 1")
    if not args.data.exists():
        p.error(f"--data {args.data} does not exist")
    try:
        cfg, graphdef, params, tokenizer = demo.load_checkpoint(args.checkpoint)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    args.retriever = args.retriever or cfg.retrieval.retriever
    model = (graphdef, params)
    t0 = time.perf_counter()
    if args.data.is_dir():
        report, examples = eval_phantomwiki(args, cfg, model, tokenizer)
    else:
        report, examples = eval_nq(args, cfg, model, tokenizer)
    report["info"].update(checkpoint=str(args.checkpoint), seconds=time.perf_counter() - t0, examples=examples)
    print_table(report)
    out = args.out or Path("runs/eval") / f"rag_qa_{args.data.name.split('.')[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"# wrote {out}")
    return report


if __name__ == "__main__":
    main()
