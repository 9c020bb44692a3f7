"""EM-LLM benchmark: streaming throughput and memory vs stream length, event lookup exact vs ScaNN, refinement cost.

Three tables, each with a baseline measured in the same run:

1. **Streaming** (``--lengths``): tokens/s of chunked prefill with EM-LLM (``--em-config``), the sliding window
   alone, and full attention (a window covering the input: exact, quadratic; up to ``--full-max`` tokens), plus the
   device bytes of the per-stream buffers (constant in the stream length by construction), the host bytes of the
   event store, and the process's peak resident memory. Ratios are tokens/s relative to full attention at the same
   length (or to the sliding window where full attention is not run).
2. **Event lookup** (``--store-sizes``): median time of one top-k search over a layer's representative vectors
   with ``EventIndex`` exact (``ExactIndex`` on the host, the baseline) vs ScaNN brute force (``scann``, the
   default: exact scores) vs ScaNN's size-based quantized search (``scann_auto``), and each one's recall@k.
3. **Boundary refinement** (``--windows``): time to score every candidate boundary of one event window with the
   O(w²) prefix sums vs the reference's O(w³) recomputation of modularity per candidate.

Small defaults finish in a few minutes on CPU; e.g. ``--lengths 1024 16384 262144 1048576`` for long streams.
The model is randomly initialised (``--preset``): throughput does not depend on the weights.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rag_jax.memory import EMLLM, EMLLMConfig, EventIndex, modularity_scores  # noqa: E402
from rag_jax.model import ModelConfig, Transformer  # noqa: E402


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def stream_table(args) -> None:
    mcfg = ModelConfig.preset(args.preset, vocab_size=256)
    model = Transformer(mcfg, rngs=nnx.Rngs(0))
    base = EMLLMConfig.from_yaml(args.em_config)
    rng = np.random.default_rng(0)
    # Byte-like text with structure (repeated sentences + random spans) so surprise varies.
    vocab = rng.integers(0, mcfg.vocab_size, (64, 24))
    methods = {"em_llm": lambda n: base, "sliding": lambda n: base.replace(memory=False),
               "full": lambda n: base.replace(n_local=n + 1, memory=False)}
    rows = []
    cache: dict = {}
    for length in args.lengths:
        tokens = np.concatenate([vocab[i] for i in rng.integers(0, len(vocab), length // 24 + 1)])[:length]
        rates = {}
        for name, make in methods.items():
            if name == "full" and length > args.full_max:
                continue
            cfg = make(length)
            em = cache.get(cfg)
            if em is None:
                em = cache[cfg] = EMLLM(model, cfg)
                em.prefill(tokens[:min(length, 2 * cfg.chunk_size + 2)])     # compile outside the timing
            times = []
            for _ in range(args.repeats):
                em.reset()
                t0 = time.perf_counter()
                em.prefill(tokens)
                times.append(time.perf_counter() - t0)
            rates[name] = length / float(np.median(times))
            rows.append((length, name, rates[name], em.device_nbytes, em.store.nbytes, len(em.store), peak_rss_mb()))
            if name == "full":
                cache.pop(cfg)       # its buffers grow with the length
        ref = rates.get("full", rates.get("sliding"))
        ref_name = "full" if "full" in rates else "sliding"
        for i, row in enumerate(rows):
            if row[0] == length:
                rows[i] = row + (f"{row[2] / ref:.2f}x vs {ref_name}",)
    print(f"\nStreaming prefill ({args.preset} model, EM-LLM {args.em_config.name}, median of {args.repeats})")
    print("| tokens | method | tokens/s | ratio | device buffers MB | host store MB | events | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|")
    for length, name, rate, dev, host, events, rss, ratio in rows:
        print(f"| {length:,} | {name} | {rate:,.0f} | {ratio} | {dev / 1e6:.2f} | {host / 1e6:.1f} | {events:,} | "
              f"{rss:,.0f} |")


def lookup_table(args) -> None:
    rng = np.random.default_rng(1)
    print(f"\nEvent lookup: one query, top-{args.k}, dim {args.dim}, median of {args.queries} queries")
    kinds = ("exact", "scann", "scann_auto")
    print("| events | exact ms | scann ms | scann_auto ms | scann speed-up | scann_auto speed-up | scann recall@k "
          "| scann_auto recall@k |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.store_sizes:
        # Clustered vectors, like representative keys of a long stream.
        centres = rng.normal(size=(max(n // 100, 1), args.dim)).astype(np.float32)
        vectors = centres[rng.integers(0, len(centres), n)] + 0.3 * rng.normal(size=(n, args.dim)).astype(np.float32)
        queries = centres[rng.integers(0, len(centres), args.queries)] + 0.3 * rng.normal(
            size=(args.queries, args.dim)).astype(np.float32)
        result = {}
        for kind in kinds:
            index = EventIndex(args.dim, kind)
            index.add(vectors, 0)
            index.search(queries[0], args.k)     # build / compile outside the timing
            times, ids = [], []
            for q in queries:
                t0 = time.perf_counter()
                ids.append(index.search(q, args.k))
                times.append(time.perf_counter() - t0)
            result[kind] = (1e3 * float(np.median(times)), ids)
        recall = {kind: np.mean([len(set(a) & set(b)) / args.k for a, b in zip(result["exact"][1], result[kind][1])])
                  for kind in kinds[1:]}
        print(f"| {n:,} | " + " | ".join(f"{result[kind][0]:.3f}" for kind in kinds) + " | "
              + " | ".join(f"{result['exact'][0] / result[kind][0]:.1f}x" for kind in kinds[1:]) + " | "
              + " | ".join(f"{recall[kind]:.3f}" for kind in kinds[1:]) + " |")


def refinement_table(args) -> None:
    rng = np.random.default_rng(2)
    print("\nBoundary refinement: score every split of one window (modularity)")
    print("| window | prefix sums ms | per-candidate recompute ms | speed-up | max abs diff |")
    print("|---|---|---|---|---|")
    for w in args.windows:
        keys = rng.normal(size=(w, 32))
        a = keys @ keys.T
        t0 = time.perf_counter()
        fast = modularity_scores(a)[1:w]
        t_fast = time.perf_counter() - t0
        t0 = time.perf_counter()
        total, k_col, k_row = a.sum(), a.sum(0), a.sum(1)
        slow = []
        for t in range(1, w):   # the reference: the whole metric again for every candidate
            q = 0.0
            for c in (np.arange(t), np.arange(t, w)):
                q += (a[np.ix_(c, c)] - np.outer(k_col[c], k_row[c]) / total).sum()
            slow.append(q / (2 * total))
        t_slow = time.perf_counter() - t0
        print(f"| {w} | {1e3 * t_fast:.2f} | {1e3 * t_slow:.1f} | {t_slow / t_fast:.0f}x | "
              f"{np.abs(fast - np.asarray(slow)).max():.1e} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--preset", default="tiny", help="ModelConfig preset (random weights, vocab 256)")
    p.add_argument("--em-config", type=Path, default=ROOT / "train" / "configs" / "em_llm_passkey.yaml")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--full-max", type=int, default=4096, help="longest stream run with full attention")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--store-sizes", type=int, nargs="+", default=[1000, 10000, 50000])
    p.add_argument("--dim", type=int, default=256, help="representative vector size (num_heads * head_dim)")
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--queries", type=int, default=50)
    p.add_argument("--windows", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--skip", nargs="*", default=[], choices=["stream", "lookup", "refinement"])
    args = p.parse_args(argv)
    if "stream" not in args.skip:
        stream_table(args)
    if "lookup" not in args.skip:
        lookup_table(args)
    if "refinement" not in args.skip:
        refinement_table(args)


if __name__ == "__main__":
    main()
