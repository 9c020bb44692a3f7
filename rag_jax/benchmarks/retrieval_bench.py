"""Retrieval benchmark: recall@k on held-out queries, build time and query time vs exact search.

Data: clustered unit vectors like real embeddings — ``--clusters`` random unit centres, each point
``normalize(centre + cluster_std · g / sqrt(dim))`` with ``g ~ N(0, I)`` (cosine to its centre
≈ 1/sqrt(1 + cluster_std²)); the queries are fresh points drawn the same way, never in the index
(held out: recall is not inflated by self-matches). Optionally real MiniLM embeddings (``--minilm``:
the NQ oracle passages, 2,655 points; needs ../shared/data).

Rows, all in one run on the same data and queries:
- ``exact numpy``: BLAS matmul + argpartition (the time baseline: speedup 1.0, and the ground truth);
- ``exact jax``: ``ExactIndex`` (JAX matmul + top_k);
- ``raw scann (example recipe)``: the ScaNN library called directly with the recipe of its
  ``docs/example.ipynb`` (glove-100-angular, 1.18M points: ``tree(num_leaves=2000,
  num_leaves_to_search=100, training_sample_size=250000)``, ``score_ah(2,
  anisotropic_quantization_threshold=0.2)``, ``reorder(100)``), the leaves scaled as ``2·sqrt(n)``
  (2000 at 1M) and the leaves searched as 1/20 of them for other sizes;
- ``ScannIndex (auto)``: our wrapper with default settings (size rules + build-time tuning);
- ``ScannIndex (target_recall=R)``: tuned for ``--target-recall`` (leaves, leaves searched, reorder).
Build times include the wrapper's tuning. Query time = median over ``--repeats`` runs of one batched
call over all queries (``search_batched_parallel``), divided by the number of queries.
``wrapper/raw`` = the same searcher called directly through ScaNN / through ``ScannIndex.search``
(1.0 = no wrapper overhead; timed interleaved, so load changes on a shared machine hit both alike).

The issue-18 table: ``rag-jax bench retrieval_bench --sizes 1000000`` (about 30 min on 2 busy CPU
cores; the default size finishes in about a minute).
"""
from __future__ import annotations

import math
import os

import numpy as np

from rag_jax.data.loaders import NQ_ORACLE, load_nq_oracle, shared_file
from rag_jax.args import ScriptParser, integer, real
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import StageTimer, median_ms
from rag_jax.metrics import recall_at_k
from rag_jax.retrieval.embedders import BertEmbedder, embed_texts
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


def example_scann(db, k):
    """-> (searcher, description): ScaNN's example recipe (module docstring), built directly."""
    from scann.scann_ops.py import scann_ops_pybind
    n = len(db)
    num_leaves = max(1, min(round(2 * math.sqrt(n)), n // 50))
    leaves = max(1, num_leaves // 20)
    searcher = scann_ops_pybind.builder(db, k, "dot_product").tree(
        num_leaves=num_leaves, num_leaves_to_search=leaves, training_sample_size=min(n, 250_000)).score_ah(
        2, anisotropic_quantization_threshold=0.2).reorder(100).build()
    return searcher, f"tree_ah, leaves {num_leaves}/{leaves}, reorder 100"


def exact_jax_row(db, ids, queries, truth, args, block: int = 100) -> dict:
    """``ExactIndex``, ``block`` queries per call like ``exact_numpy`` (1000 x 1M scores would take 4 GB)."""
    timer = StageTimer()
    ex = ExactIndex(db.shape[1])
    ex.add(db, ids)
    ex.search(queries[:1], args.k)  # device copy
    timer.stage("build")

    def search():
        return np.concatenate([ex.search(queries[i:i + block], args.k)[1] for i in range(0, len(queries), block)])
    search()  # compile for these batch sizes
    found, t = timed(search, args.repeats)
    return {"method": "exact jax", "build_s": timer.wall["build"], "search_s": t,
            "recall": recall_at_k(found, truth, truth.shape[1])}


def example_scann_row(db, queries, truth, args) -> dict:
    timer = StageTimer()
    raw, desc = example_scann(db, args.k)
    timer.stage("build")
    raw.search_batched_parallel(queries)
    found, t = timed(lambda: raw.search_batched_parallel(queries)[0], args.repeats)
    return {"method": "raw scann (example recipe)", "build_s": timer.wall["build"], "search_s": t,
            "recall": recall_at_k(found.astype(np.int64), truth, truth.shape[1]), "params": desc}


def wrapper_row(label: str, cfg: ScannConfig, db, ids, queries, truth, args) -> dict:
    """``ScannIndex`` row; its own searcher called directly through ScaNN gives ``wrapper/raw``."""
    k = args.k
    timer = StageTimer()
    ours = ScannIndex(db.shape[1], cfg)
    ours.add(db, ids)
    ours.build()
    timer.stage("build")
    params = ours.params
    pre = max(params["reorder"], k) if params["reorder"] is not None else None

    def direct():
        return ours._searcher.search_batched_parallel(queries, final_num_neighbors=k, pre_reorder_num_neighbors=pre,
                                                      leaves_to_search=params["leaves_to_search"])
    direct()
    ours.search(queries, k)
    direct_times, our_times = [], []
    for _ in range(args.repeats):  # interleaved, so load changes on a shared machine hit both alike
        direct_times.append(timed(direct, 1)[1])
        (_, found), t = timed(lambda: ours.search(queries, k), 1)
        our_times.append(t)
    t_ours = float(np.median(our_times))
    desc = f"{params['mode']}, leaves {params['num_leaves']}/{params['leaves_to_search']}, reorder {params['reorder']}"
    if ours.tuning is not None:
        desc += f"; sample recall {ours.tuning['recall']:.4f}"
    return {"method": f"ScannIndex ({label})", "build_s": timer.wall["build"], "search_s": t_ours,
            "recall": recall_at_k(found, truth, truth.shape[1]), "params": desc,
            "wrapper": float(np.median(direct_times)) / t_ours}


def bench(name: str, db: np.ndarray, queries: np.ndarray, args) -> list[dict]:
    """All rows on one database (module docstring); one index alive at a time (1M x 384 float32 is 1.5 GB)."""
    ids = np.arange(len(db), dtype=np.int64)
    truth, t_np = timed(lambda: exact_numpy(db, queries, args.k), args.repeats)
    runs = [lambda: exact_jax_row(db, ids, queries, truth, args), lambda: example_scann_row(db, queries, truth, args)]
    for label, cfg in (("auto", ScannConfig(num_neighbors=args.k)),
                       (f"target_recall={args.target_recall}",
                        ScannConfig(num_neighbors=args.k, target_recall=args.target_recall))):
        runs.append(lambda label=label, cfg=cfg: wrapper_row(label, cfg, db, ids, queries, truth, args))
    rows = [{"method": "exact numpy", "build_s": 0.0, "search_s": t_np, "recall": 1.0}]
    for run in runs:  # one index alive at a time
        rows.append(run())
        r = rows[-1]
        print(f"# {name}, {r['method']}: recall {r['recall']:.4f}, build {r['build_s']:.0f} s, "
              f"{t_np / r['search_s']:.1f}x exact numpy", flush=True)
    for r in rows:
        r["data"] = name
        r["ms"] = 1e3 * r["search_s"] / len(queries)
        r["speedup"] = t_np / r["search_s"]
    return rows


def print_table(rows: list[dict], k: int) -> None:
    print(table(["data", "method", f"recall@{k}", "build s", "query ms", "x exact numpy", "wrapper/raw", "params"],
                [[r["data"], r["method"], r["recall"], r["build_s"], r["ms"], r["speedup"], r.get("wrapper", ""),
                  r.get("params", "")] for r in rows],
                floatfmt=("", "", ".4f", ".1f", ".4f", ".1f", ".3f")))


def main(argv=None) -> int:
    p = ScriptParser(prog="rag-jax bench retrieval_bench", description=__doc__)
    p.add_argument("--sizes", type=integer(1), nargs="+", default=[20_000], help="database sizes (vectors)")
    p.add_argument("--dim", type=integer(1), default=384)
    p.add_argument("--clusters", type=integer(1), default=None,
                   help="Gaussian clusters (default n/500, e.g. 2000 at 1M)")
    p.add_argument("--cluster-std", type=real(0), default=1.0, help="noise norm relative to the unit centre")
    p.add_argument("--queries", type=integer(1), default=1000)
    p.add_argument("--k", type=integer(1), default=10)
    p.add_argument("--target-recall", type=real(0, 1, lo_open=True), default=0.99)
    p.add_argument("--repeats", type=integer(1), default=5, help="timed repeats per method (median)")
    p.add_argument("--minilm", action="store_true", help="also run on real MiniLM embeddings of the NQ passages")
    p.add_argument("--seed", type=integer(0), default=0)
    args = p.parse_args(argv)
    if args.k > min(args.sizes):
        p.error(f"argument --k: {args.k} exceeds the smallest --sizes value {min(args.sizes)}")
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
