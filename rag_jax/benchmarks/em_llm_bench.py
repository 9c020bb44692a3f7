"""EM-LLM benchmark: streaming throughput and memory vs stream length, event lookup exact vs ScaNN, refinement cost.

Three tables, each with a baseline measured in the same run:

1. **Streaming** (``--lengths``): tokens/s of chunked prefill with EM-LLM (``--em-config``), the sliding window
   alone, and full attention (a window covering the input: exact, quadratic; up to ``--full-max`` tokens), plus the
   device bytes of the per-stream buffers (constant in the stream length by construction), the host bytes of the
   event store, and the process's peak resident memory. Ratios are tokens/s relative to full attention at the same
   length (or to the sliding window where full attention is not run). A timed run is ``reset`` + prefill.
2. **Event lookup** (``--store-sizes``): median time of one top-k search over a layer's representative vectors
   with ``EventIndex`` exact (``ExactIndex`` on the host, the baseline) vs ScaNN brute force (``scann``, the
   default: exact scores) vs ScaNN's size-based quantized search (``scann_auto``), and each one's recall@k.
3. **Boundary refinement** (``--windows``): time to score every candidate boundary of one event window with the
   O(w²) prefix sums vs the reference's O(w³) recomputation of modularity per candidate.

Small defaults finish in a few minutes on CPU; e.g. ``--lengths 1024 16384 262144 1048576`` for long streams.
The model is randomly initialised (``--preset``): throughput does not depend on the weights.
"""
from __future__ import annotations

import resource
from pathlib import Path

import numpy as np
from flax import nnx

from rag_jax.evaluation.args import ScriptParser, input_file, integer
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import median_ms, times_ms
from rag_jax.memory import EMLLM, EMLLMConfig, EventIndex, modularity_scores
from rag_jax.metrics import recall_at_k
from rag_jax.model import ModelConfig, Transformer
from rag_jax.model.config import PRESETS

EM_CONFIG = Path(__file__).resolve().parents[2] / "train" / "configs" / "em_llm_passkey.yaml"


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
            seconds = median_ms(lambda: (em.reset(), em.prefill(tokens)), args.repeats, warmup=0) / 1e3
            rates[name] = length / seconds
            rows.append([length, name, rates[name], em.device_nbytes / 1e6, em.store.nbytes / 1e6, len(em.store),
                         peak_rss_mb()])
            if name == "full":
                cache.pop(cfg)       # its buffers grow with the length
        ref = rates.get("full", rates.get("sliding"))
        ref_name = "full" if "full" in rates else "sliding"
        for row in rows:
            if row[0] == length:
                row.insert(3, f"{row[2] / ref:.2f}x vs {ref_name}")
    print(f"\nStreaming prefill ({args.preset} model, EM-LLM {args.em_config.name}, median of {args.repeats})")
    print(table(["tokens", "method", "tokens/s", "ratio", "device buffers MB", "host store MB", "events",
                 "peak RSS MB"], rows, floatfmt=(",.0f", "", ",.0f", "", ".2f", ".1f", ",.0f", ",.0f")))


def lookup_table(args) -> None:
    rng = np.random.default_rng(1)
    print(f"\nEvent lookup: one query, top-{args.k}, dim {args.dim}, median of {args.queries} queries")
    kinds = ("exact", "scann", "scann_auto")
    rows = []
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
            ids, pending = [], iter(queries)
            times = times_ms(lambda: ids.append(index.search(next(pending), args.k)), len(queries), warmup=0)
            result[kind] = (float(np.median(times)), ids)
        recall = {kind: recall_at_k(result[kind][1], result["exact"][1], args.k) for kind in kinds[1:]}
        rows.append([n, *(result[kind][0] for kind in kinds), *(f"{result['exact'][0] / result[kind][0]:.1f}x"
                                                                for kind in kinds[1:]),
                     *(recall[kind] for kind in kinds[1:])])
    print(table(["events", "exact ms", "scann ms", "scann_auto ms", "scann speed-up", "scann_auto speed-up",
                 "scann recall@k", "scann_auto recall@k"], rows, floatfmt=(",.0f", ".3f", ".3f", ".3f", "", "", ".3f",
                                                                            ".3f")))


def refinement_table(args) -> None:
    rng = np.random.default_rng(2)
    print("\nBoundary refinement: score every split of one window (modularity)")
    rows = []
    for w in args.windows:
        keys = rng.normal(size=(w, 32))
        a = keys @ keys.T
        out = {}
        t_fast = median_ms(lambda: out.update(fast=modularity_scores(a)[1:w]), 1, warmup=0)
        t_slow = median_ms(lambda: out.update(slow=_recompute_modularity(a)), 1, warmup=0)
        rows.append([w, t_fast, t_slow, f"{t_slow / t_fast:.0f}x", f"{np.abs(out['fast'] - out['slow']).max():.1e}"])
    print(table(["window", "prefix sums ms", "per-candidate recompute ms", "speed-up", "max abs diff"], rows,
                floatfmt=("", ".2f", ".1f")))


def _recompute_modularity(a: np.ndarray) -> np.ndarray:
    """The reference's O(w³) scoring: the whole modularity again for every candidate split ``t`` in 1..w-1."""
    w = len(a)
    total, k_col, k_row = a.sum(), a.sum(0), a.sum(1)
    slow = []
    for t in range(1, w):
        q = 0.0
        for c in (np.arange(t), np.arange(t, w)):
            q += (a[np.ix_(c, c)] - np.outer(k_col[c], k_row[c]) / total).sum()
        slow.append(q / (2 * total))
    return np.asarray(slow)


def main(argv=None) -> int:
    p = ScriptParser(prog="rag-jax bench em_llm_bench", description=__doc__.split("\n\n")[0], epilog=__doc__)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                   help="ModelConfig preset (random weights, vocab 256)")
    p.add_argument("--em-config", type=input_file, default=str(EM_CONFIG))
    p.add_argument("--lengths", type=integer(1), nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--full-max", type=integer(1), default=4096, help="longest stream run with full attention")
    p.add_argument("--repeats", type=integer(1), default=3)
    p.add_argument("--store-sizes", type=integer(1), nargs="+", default=[1000, 10000, 50000])
    p.add_argument("--dim", type=integer(1), default=256, help="representative vector size (num_heads * head_dim)")
    p.add_argument("--k", type=integer(1), default=16)
    p.add_argument("--queries", type=integer(1), default=50)
    p.add_argument("--windows", type=integer(1), nargs="+", default=[64, 128, 256])
    p.add_argument("--skip", nargs="*", default=[], choices=["stream", "lookup", "refinement"])
    args = p.parse_args(argv)
    EMLLMConfig.from_yaml(args.em_config)  # a bad config fails before the first table
    if "stream" not in args.skip:
        stream_table(args)
    if "lookup" not in args.skip:
        lookup_table(args)
    if "refinement" not in args.skip:
        refinement_table(args)
    return 0
