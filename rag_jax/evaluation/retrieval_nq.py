"""Retrieval recall@1/5/20 of MiniLM on the NQ-open oracle set: exact search vs ScaNN.

Data: ``../shared/data/lost_in_the_middle/nq-open-oracle.jsonl.gz`` (Liu et al., "Lost in the
Middle", TACL 2024): 2,655 NQ-open questions, each with its gold Wikipedia passage. The pool is
every gold passage (duplicates — the same title and text for several questions — merged); a question
scores a hit at k if its own gold passage is among the top k. Passages are embedded as
``"{title}\\n{text}"`` (``Chunk.contents``), questions as is, with ``BertEmbedder`` (all-MiniLM-L6-v2).

Rows: exact (``ExactIndex``), ScaNN with the size rules (brute force at this size), and ScaNN forced
to AH + reorder and to tree + AH + reorder (``target_recall`` tuned), which is what larger corpora
use; and BM25 over the same texts (``rag_jax.retrieval.lexical``), the lexical baseline. ``agree@20`` is the
overlap of each method's top 20 with exact MiniLM search.

    rag-jax eval retrieval_nq                 # all 2,655 questions (minutes on 2 CPU cores)
    rag-jax eval retrieval_nq --limit 300     # quick run: first 300 questions, their passages
"""
from __future__ import annotations


import numpy as np

from rag_jax.data.loaders import NQ_ORACLE, load_nq_oracle, nq_passage_pool, shared_file
from rag_jax.args import ScriptParser, input_file, integer, output_file, real
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import StageTimer
from rag_jax.metrics import hit_at_k, recall_at_k
from rag_jax.retrieval.embedders import BertEmbedder, embed_texts
from rag_jax.retrieval.exact import ExactIndex
from rag_jax.retrieval.lexical import BM25Index
from rag_jax.retrieval.scann_index import ScannConfig, ScannIndex

KS = (1, 5, 20)


def main(argv=None) -> int:
    p = ScriptParser(prog="rag-jax eval retrieval_nq", description=__doc__)
    p.add_argument("--data", type=input_file, default=str(shared_file(*NQ_ORACLE)),
                   help="NQ-open oracle file (it lives in ../shared/data; see its README)")
    p.add_argument("--limit", type=integer(1), default=None, help="first N questions (and their passages) only")
    p.add_argument("--max-length", type=integer(1), default=256,
                   help="MiniLM tokens per text (sentence-transformers: 256)")
    p.add_argument("--batch-size", type=integer(1), default=64)
    p.add_argument("--cache", type=output_file, default=None, help="npz file to reuse/store the embeddings")
    p.add_argument("--target-recall", type=real(0, 1, lo_open=True), default=0.99, help="for the tuned tree row")
    args = p.parse_args(argv)

    examples = load_nq_oracle(args.data, args.limit)
    questions = [ex.question for ex in examples]
    passages, gold = nq_passage_pool(examples)
    gold = [[g] for g in gold]
    print(f"# NQ-open oracle: {len(questions)} questions, pool of {len(passages)} gold passages", flush=True)

    timer = StageTimer()
    if args.cache is not None and args.cache.is_file():
        cached = np.load(args.cache)
        q_vecs, p_vecs = cached["questions"], cached["passages"]
        if q_vecs.shape[0] != len(questions) or p_vecs.shape[0] != len(passages):
            p.error(f"--cache {args.cache} does not match this data/--limit; delete it")
        embed_s = float("nan")
    else:
        emb = BertEmbedder(max_length=args.max_length, batch_size=args.batch_size)
        p_vecs = embed_texts(emb, [f"{x.title}\n{x.text}" for x in passages], desc="passages")
        q_vecs = embed_texts(emb, questions, desc="questions")
        timer.stage("embed")
        embed_s = timer.wall["embed"]
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
        timer.stage("idle")
        index.add(p_vecs, ids)
        if isinstance(index, ScannIndex):
            index.build()
        timer.stage("build")
        _, found = index.search(q_vecs, k_max)
        timer.stage("search")
        results[name] = (found, timer.wall["build"], timer.wall["search"], getattr(index, "params", {}))
    timer.stage("idle")
    bm25 = BM25Index([f"{x.title}\n{x.text}" for x in passages])
    timer.stage("build")
    _, found = bm25.search(questions, k_max)
    timer.stage("search")
    results["BM25 (bm25s)"] = (found, timer.wall["build"], timer.wall["search"], {"k1": bm25.k1, "b": bm25.b})
    exact_found = results["exact (ExactIndex)"][0]
    rows = []
    for name, (found, build_s, search_s, params) in results.items():
        desc = ", ".join(f"{key}={v}" for key, v in params.items() if v is not None)
        rows.append([name, *(hit_at_k(found, gold, k) for k in KS), recall_at_k(found, exact_found, k_max),
                     build_s, search_s, desc])
    print(table(["method", *(f"recall@{k}" for k in KS), "agree@20 vs exact", "build s", "search s", "params"], rows,
                floatfmt=(".4f",) * (len(KS) + 2) + (".2f", ".3f")))
    return 0
