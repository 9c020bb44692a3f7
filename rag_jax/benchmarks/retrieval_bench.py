"""Retrieval benchmark: build time, QPS and recall@k vs exact for exact search, raw ScaNN and our wrapper.

Data: clustered unit vectors like real embeddings — ``--clusters`` random unit centres, each point
``normalize(centre + cluster_std · g / sqrt(dim))`` with ``g ~ N(0, I)`` (cosine to its centre
≈ 1/sqrt(1 + cluster_std²)); queries are fresh points drawn the same way. Optionally real MiniLM
embeddings (``--minilm``: the NQ oracle passages, 2,655 points; needs ../shared/data).

Rows, all in one run on the same data and queries:
- ``exact numpy``: BLAS matmul + argpartition (the QPS baseline, speedup 1.0);
- ``exact jax``: ``ExactIndex`` (JAX matmul + top_k);
- ``raw scann (auto params)`` vs ``ScannIndex (auto)``: the parameters our size rules pick, built
  and searched directly with ``scann_ops_pybind`` vs through our wrapper (equal recall expected);
- ``raw scann (tuned params)`` vs ``ScannIndex (target_recall)``: the wrapper tunes
  leaves_to_search/reorder for ``--target-recall``; raw ScaNN is searched with the same values.
QPS = queries / median search time over ``--repeats`` runs (all queries in one batched call; raw and
wrapper runs interleaved).
``wrapper/raw`` compares our wrapper's QPS with raw ScaNN at the same parameters.

Example: ``rag-jax bench retrieval_bench --sizes 100000 1000000`` (the issue's sizes; the default
is small so it finishes in about a minute).
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from rag_jax.data.loaders import NQ_ORACLE, load_nq_oracle, shared_file
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import StageTimer, median_ms
from rag_jax.metrics import recall_at_k
from rag_jax.retrieval.exact import ExactIndex
from rag_jax.retrieval.scann_index import ScannConfig, ScannIndex


def _unit(a: np.ndarray) -> np.ndarray:
    return (a / np.linalg.norm(a, axis=1, keepdims=True)).astype(np.float32)


def clustered(n: int, num_queries: int, dim: int, clusters: int, std: float, seed: int):
    """-> (database float32 [n, dim], queries float32 [num_queries, dim]), unit rows."""
    rng = np.random.default_rng(seed)
    centres = _unit(rng.standard_normal((clusters, dim)))

    def draw(m):
        out = np.empty((m, dim), np.float32)
        for start in range(0, m, 100_000):  # bounded temporaries at 1M+
            size = min(100_000, m - start)
            g = rng.standard_normal((size, dim), dtype=np.float32)
            out[start:start + size] = _unit(centres[rng.integers(0, clusters, size)] + std * g / np.sqrt(dim))
        return out
    return draw(n), draw(num_queries)


def minilm_nq(num_queries: int):
    """-> (passage embeddings [2655, 384], question embeddings [num_queries, 384]) with BertEmbedder."""
    from rag_jax.retrieval.embedders import BertEmbedder, embed_texts
    examples = load_nq_oracle(shared_file(*NQ_ORACLE))
    emb = BertEmbedder()
    db = embed_texts(emb, [f"{ex.gold.title}\n{ex.gold.text}" for ex in examples], desc="passages")
    qs = embed_texts(emb, [ex.question for ex in examples[:num_queries]], desc="questions")
    return db, qs


def timed(fn, repeats: int):
    """-> (result of the last call, median seconds over ``repeats`` calls; ``rag_jax.evaluation.timing``)."""
    out = []
    seconds = median_ms(lambda: out.append(fn()), repeats, warmup=0) / 1e3
    return out[-1], seconds


def exact_numpy(db, queries, k, block: int = 100):
    """Top-k ids by BLAS matmul + argpartition, ``block`` queries at a time (a 1000 x 1M score matrix
    would take 4 GB)."""
    out = []
    for start in range(0, len(queries), block):
        scores = queries[start:start + block] @ db.T
        part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(scores, part, 1), axis=1)
        out.append(np.take_along_axis(part, order, 1))
    return np.concatenate(out)


def raw_scann(db, k, params, cfg: ScannConfig):
    """The same ScaNN configuration as ScannIndex.build, called directly (the baseline)."""
    from scann.scann_ops.py import scann_ops_pybind
    builder = scann_ops_pybind.builder(db, k, "dot_product")
    sample = min(cfg.training_sample_size, len(db))
    if params["mode"] == "tree_ah":
        builder = builder.tree(params["num_leaves"], params["leaves_to_search"], training_sample_size=sample)
    if params["mode"] == "brute_force":
        return builder.score_brute_force().build()
    return builder.score_ah(cfg.dims_per_block, anisotropic_quantization_threshold=params["anisotropic_threshold"],
                            training_sample_size=sample).reorder(params["reorder"]).build()


def recall_at(found: np.ndarray, truth: np.ndarray) -> float:
    """recall@k of ``found`` against the exact neighbours ``truth`` [q, k] (``rag_jax.metrics.recall_at_k``)."""
    return recall_at_k(found, truth, truth.shape[1])


def bench(name: str, db: np.ndarray, queries: np.ndarray, args) -> list[dict]:
    k, n = args.k, len(db)
    ids = np.arange(n, dtype=np.int64)
    rows = []
    truth, t_np = timed(lambda: exact_numpy(db, queries, k), args.repeats)
    rows.append({"method": "exact numpy", "build_s": 0.0, "search_s": t_np, "recall": 1.0})

    timer = StageTimer()
    ex = ExactIndex(db.shape[1])
    ex.add(db, ids)
    ex.search(queries[:1], k)  # device copy
    timer.stage("build")
    build = timer.wall["build"]
    ex.search(queries, k)  # compile for this batch size
    (_, found), t = timed(lambda: ex.search(queries, k), args.repeats)
    rows.append({"method": "exact jax", "build_s": build, "search_s": t, "recall": recall_at(found, truth)})

    for label, cfg in (("auto", ScannConfig(num_neighbors=k)),
                       (f"target_recall={args.target_recall}", ScannConfig(num_neighbors=k,
                                                                         target_recall=args.target_recall))):
        timer.stage("idle")
        ours = ScannIndex(db.shape[1], cfg)
        ours.add(db, ids)
        ours.build()
        timer.stage("build")
        build = timer.wall["build"]
        params = ours.params
        raw = raw_scann(db, k, params, cfg)
        timer.stage("raw build")
        raw_build = timer.wall["raw build"]
        pre = max(params["reorder"], k) if params["reorder"] is not None else None

        def raw_search():
            return raw.search_batched_parallel(queries, final_num_neighbors=k, pre_reorder_num_neighbors=pre,
                                               leaves_to_search=params["leaves_to_search"])[0]
        raw_search()
        ours.search(queries, k)
        # Interleaved repeats, so load changes on a shared machine hit both sides alike.
        raw_times, our_times = [], []
        for _ in range(args.repeats):
            raw_found, t = timed(raw_search, 1)
            raw_times.append(t)
            (_, found), t = timed(lambda: ours.search(queries, k), 1)
            our_times.append(t)
        t_raw, t_ours = float(np.median(raw_times)), float(np.median(our_times))
        desc = (f"{params['mode']}, leaves {params['num_leaves']}/{params['leaves_to_search']}, "
                f"reorder {params['reorder']}")
        rows.append({"method": f"raw scann ({label} params)", "build_s": raw_build, "search_s": t_raw,
                     "recall": recall_at(raw_found.astype(np.int64), truth), "params": desc})
        rows.append({"method": f"ScannIndex ({label})", "build_s": build, "search_s": t_ours,
                     "recall": recall_at(found, truth), "params": desc, "raw_s": t_raw})
    for r in rows:
        r["data"] = name
        r["qps"] = len(queries) / r["search_s"]
        r["speedup"] = t_np / r["search_s"]
    return rows


def print_table(rows: list[dict], k: int) -> None:
    print(table(["data", "method", "build s", "QPS", "x exact numpy", f"recall@{k}", "wrapper/raw QPS", "params"],
                [[r["data"], r["method"], r["build_s"], r["qps"], r["speedup"], r["recall"],
                  r["raw_s"] / r["search_s"] if "raw_s" in r else "", r.get("params", "")] for r in rows],
                floatfmt=("", "", ".2f", ".0f", ".1f", ".4f", ".3f")))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="rag-jax bench retrieval_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[20_000], help="database sizes (vectors)")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--clusters", type=int, default=None, help="Gaussian clusters (default n/500, e.g. 2000 at 1M)")
    p.add_argument("--cluster-std", type=float, default=1.0, help="noise norm relative to the unit centre")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--target-recall", type=float, default=0.99)
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per method (median)")
    p.add_argument("--minilm", action="store_true", help="also run on real MiniLM embeddings of the NQ passages")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(f"# retrieval bench: dim={args.dim} queries={args.queries} k={args.k} cpus={os.cpu_count()}", flush=True)
    rows = []
    for n in args.sizes:
        clusters = args.clusters or max(1, n // 500)
        db, queries = clustered(n, args.queries, args.dim, clusters, args.cluster_std, args.seed)
        rows += bench(f"clustered {n:,} ({clusters} clusters)", db, queries, args)
    if args.minilm:
        db, queries = minilm_nq(args.queries)
        rows += bench(f"MiniLM NQ passages {len(db):,}", db, queries, args)
    print_table(rows, args.k)
    return 0
