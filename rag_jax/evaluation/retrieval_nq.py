"""Retrieval recall@1/5/20 of MiniLM on the NQ-open oracle set: exact search vs ScaNN.

Data: ``../shared/data/lost_in_the_middle/nq-open-oracle.jsonl.gz`` (Liu et al., "Lost in the
Middle", TACL 2024): 2,655 NQ-open questions, each with its gold Wikipedia passage. The pool is
every gold passage (duplicates — the same title and text for several questions — merged); a question
scores a hit at k if its own gold passage is among the top k. Passages are embedded as
``"{title}\\n{text}"`` (``Chunk.contents``), questions as is, with ``BertEmbedder`` (all-MiniLM-L6-v2).

Rows: exact (``ExactIndex``), ScaNN with the size rules (brute force at this size), and ScaNN forced
to AH + reorder and to tree + AH + reorder (``target_recall`` tuned), which is what larger corpora
use. ``agree@20`` is the overlap of each method's top 20 with exact search.

    python eval/retrieval_nq.py                 # all 2,655 questions (minutes on 2 CPU cores)
    python eval/retrieval_nq.py --limit 300     # quick run: first 300 questions, their passages
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rag_jax.retrieval.embedders import BertEmbedder, embed_texts  # noqa: E402
from rag_jax.retrieval.exact import ExactIndex  # noqa: E402
from rag_jax.retrieval.scann_index import ScannConfig, ScannIndex  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "lost_in_the_middle" / \
    "nq-open-oracle.jsonl.gz"
KS = (1, 5, 20)


def load_oracle(path: Path, limit: int | None):
    """-> (questions [q], passages [p] as (title, text), gold pool row per question [q])."""
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    rows = rows[:limit] if limit else rows
    pool, gold = {}, []
    for r in rows:
        ctx = next(c for c in r["ctxs"] if c.get("isgold", True))
        gold.append(pool.setdefault((ctx["title"], ctx["text"]), len(pool)))
    return [r["question"] for r in rows], list(pool), np.asarray(gold)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--limit", type=int, default=None, help="first N questions (and their passages) only")
    p.add_argument("--max-length", type=int, default=256, help="MiniLM tokens per text (sentence-transformers: 256)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--cache", type=Path, default=None, help="npz file to reuse/store the embeddings")
    p.add_argument("--target-recall", type=float, default=0.99, help="for the tuned tree row")
    args = p.parse_args(argv)
    if not args.data.is_file():
        raise SystemExit(f"NQ oracle file {args.data} not found (it lives in ../shared/data; see its README)")
    questions, passages, gold = load_oracle(args.data, args.limit)
    print(f"# NQ-open oracle: {len(questions)} questions, pool of {len(passages)} gold passages", flush=True)

    if args.cache is not None and args.cache.is_file():
        cached = np.load(args.cache)
        q_vecs, p_vecs = cached["questions"], cached["passages"]
        if q_vecs.shape[0] != len(questions) or p_vecs.shape[0] != len(passages):
            raise SystemExit(f"--cache {args.cache} does not match this data/--limit; delete it")
        embed_s = float("nan")
    else:
        start = time.perf_counter()
        emb = BertEmbedder(max_length=args.max_length, batch_size=args.batch_size)
        p_vecs = embed_texts(emb, [f"{t}\n{x}" for t, x in passages], desc="passages")
        q_vecs = embed_texts(emb, questions, desc="questions")
        embed_s = time.perf_counter() - start
        if args.cache is not None:
            np.savez(args.cache, questions=q_vecs, passages=p_vecs)
    print(f"# embedding: {embed_s:.1f} s", flush=True)

    ids = np.arange(len(passages))
    n = len(passages)
    leaves = max(2, min(round(np.sqrt(n)), n // 50))
    methods = {
        "exact (ExactIndex)": ExactIndex(p_vecs.shape[1]),
        "ScaNN auto (size rules)": ScannIndex(p_vecs.shape[1]),
        "ScaNN AH + reorder 40": ScannIndex(p_vecs.shape[1], ScannConfig(mode="ah", num_neighbors=20,
                                                                          reorder_num_neighbors=40)),
        f"ScaNN tree {leaves} leaves + AH, target {args.target_recall}": ScannIndex(
            p_vecs.shape[1], ScannConfig(mode="tree_ah", num_neighbors=20, num_leaves=leaves,
                                         target_recall=args.target_recall)),
    }
    k_max = max(KS)
    results = {}
    for name, index in methods.items():
        start = time.perf_counter()
        index.add(p_vecs, ids)
        if isinstance(index, ScannIndex):
            index.build()
        build_s = time.perf_counter() - start
        start = time.perf_counter()
        _, found = index.search(q_vecs, k_max)
        search_s = time.perf_counter() - start
        results[name] = (found, build_s, search_s, getattr(index, "params", {}))
    exact_found = results["exact (ExactIndex)"][0]
    print("| method | " + " | ".join(f"recall@{k}" for k in KS) +
          " | agree@20 vs exact | build s | search s | params |")
    print("|---|" + "---:|" * (len(KS) + 3) + "---|")
    for name, (found, build_s, search_s, params) in results.items():
        recalls = [np.mean((found[:, :k] == gold[:, None]).any(axis=1)) for k in KS]
        agree = np.mean([len(np.intersect1d(a, b)) for a, b in zip(found, exact_found)]) / k_max
        desc = ", ".join(f"{key}={v}" for key, v in params.items() if v is not None)
        print(f"| {name} | " + " | ".join(f"{r:.4f}" for r in recalls) +
              f" | {agree:.4f} | {build_s:.2f} | {search_s:.3f} | {desc} |")


if __name__ == "__main__":
    main()
