"""Prefill throughput and peak memory per attention implementation vs HF transformers (sdpa), CPU.

Each measurement runs in its own subprocess (peak RSS is per process): load the weights, record the RSS
(``load MB``), compile the forward ahead of time (logits of the last token only; unused outputs are dead
code), then the median wall time of ``--repeats`` prefills after one warm-up call on both sides (a compiled
program's or a torch model's first call pays first-touch page faults and thread start-up). Rows: one per
(length, implementation);
``x hf`` = tokens/s relative to transformers' in the same run, ``peak-load MB`` = peak RSS minus the
RSS after loading (what the prefill itself needed).

    # SmolLM2-135M fp32 (the embedded GGUF, converted once to an HF folder for both sides)
    rag-jax bench attention --sizes 1024,4096,8192 --impls dense,blockwise
    # both sides on the same 2 cores (each worker process pinned with CPU affinity), wall clock
    rag-jax bench attention --sizes 1024,4096,8192 --impls blockwise --threads 2
    # three rounds per length, the sides alternating (a row: the median over rounds; per-round ratios printed)
    rag-jax bench attention --sizes 1024,4096,8192 --impls blockwise --threads 2 --rounds 3
    # on a busy shared machine: one core each, CPU-time clock
    rag-jax bench attention --sizes 1024 --threads 1 --clock cpu
    # 4-layer toy config at lengths dense cannot hold
    rag-jax bench attention --toy --sizes 32768,65536 --impls blockwise --no_hf --repeats 1
    # the attention kernel alone: one layer's causal attention (the model's head counts and head_dim,
    # fp32, random q/k/v) vs torch's scaled_dot_product_attention (its fused CPU flash kernel)
    rag-jax bench attention --kernel --sizes 8192 --impls blockwise --threads 1 --clock cpu

Measured ratios (with the command, the machine and its load) are in README.md's Results and
``bench/PROFILE.md``, not here.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import jax
import numpy as np

from rag_jax.args import ScriptParser, int_list, integer, model_source, names
from rag_jax.evaluation.timing import clock_fn, cpu_threads, median_ms
from rag_jax.model import ModelConfig, Transformer
from rag_jax.model.attention import attend
from rag_jax.model.config import ATTENTION_IMPLS
from rag_jax.model.gguf import convert_gguf
from rag_jax.model.hf import config_from_hf, load_hf
from rag_jax.model.load import resolve_model
from rag_jax.model.masks import MaskSpec
from rag_jax.model.xla_options import forward_options, jit_by_options

TOY = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    """This process's peak RSS (``VmHWM``). Not ``ru_maxrss``: Linux carries that over from the parent
    across fork + exec, so every worker would report at least the parent's peak (e.g. a GGUF conversion)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _time(fn, repeats: int, clock) -> float:
    return median_ms(fn, repeats, warmup=1, clock=clock) / 1e3


def _head_dims(args) -> tuple[int, int, int]:
    """(num_heads, num_kv_heads, head_dim) of the toy config or of ``--hf_dir``'s config.json."""
    if args.toy:
        cfg = ModelConfig(**TOY)
    else:
        with open(os.path.join(args.hf_dir, "config.json")) as f:
            cfg = config_from_hf(json.load(f))[0]
    return cfg.num_heads, cfg.num_kv_heads, cfg.head_dim


def kernel_run(impl: str, length: int, args):
    """``run()`` for one layer's causal attention over ``length`` tokens: torch sdpa for ``hf``, else
    ``rag_jax.model.attention.attend`` with ``impl`` (compiled ahead)."""
    heads, kv_heads, d = _head_dims(args)
    rng = np.random.default_rng(args.seed)
    q, k, v = (rng.standard_normal((1, length, n, d), dtype=np.float32) for n in (heads, kv_heads, kv_heads))
    if impl == "hf":
        import torch
        tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v))

        @torch.inference_mode()
        def run():
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
        return run
    import jax.numpy as jnp

    seg = jnp.ones((1, length), jnp.int32)
    fn = jax.jit(lambda q, k, v, seg: attend(q, k, v, MaskSpec.create("causal", seg, seg), impl=impl))
    arrays = [jnp.asarray(x) for x in (q, k, v)] + [seg]
    compiled = fn.lower(*arrays).compile()
    return lambda: compiled(*arrays).block_until_ready()


def worker(impl: str, length: int, args) -> dict:
    """One measurement in this process: ``impl`` in ATTENTION_IMPLS or ``hf``."""
    tokens = np.random.default_rng(args.seed).integers(1, 4000, (1, length))
    # e.g. no TPU runtime probe (and its memory) on a CPU bench; the config, not JAX_PLATFORMS: jax is imported
    jax.config.update("jax_platforms", args.platform)
    cpu_threads(args.threads)  # read when the XLA backend starts, not at import
    if impl == "hf" and args.threads:
        import torch
        torch.set_num_threads(args.threads)
    if args.kernel:
        load = _rss_mb()
        run = kernel_run(impl, length, args)
    elif impl == "hf":
        import torch
        from transformers import LlamaForCausalLM
        model = LlamaForCausalLM.from_pretrained(args.hf_dir, torch_dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
        load = _rss_mb()
        ids = torch.tensor(tokens)

        @torch.inference_mode()
        def run():
            return model(ids, use_cache=False, logits_to_keep=1).logits
    else:
        import jax.numpy as jnp
        from flax import nnx

        if args.toy:
            cfg = ModelConfig(**TOY, max_seq_len=length, attention_impl=impl)
            model = Transformer(cfg, rngs=nnx.Rngs(args.seed))
        else:
            cfg, model, _ = load_hf(args.hf_dir, dtype="float32")
            model.config = cfg.replace(attention_impl=impl, max_seq_len=max(cfg.max_seq_len, length))
        graphdef, state = nnx.split(model)
        load = _rss_mb()

        def fwd(state, tokens, positions, segment_ids):
            m = nnx.merge(graphdef, state)
            return m.logits(m(tokens, positions, segment_ids).hidden[:, -1:])

        toks = jnp.asarray(tokens, jnp.int32)
        pos = jnp.arange(length, dtype=jnp.int32)[None]
        seg = jnp.ones_like(toks)
        # compiled ahead (the warm-up call does not compile), with the library's prefill options (xla_options)
        compiled = jit_by_options(fwd)(forward_options(length)).lower(state, toks, pos, seg).compile()

        def run():
            return compiled(state, toks, pos, seg).block_until_ready()
    clock = clock_fn(args.clock)
    seconds = _time(run, args.repeats, clock=clock)
    return dict(impl=impl, tokens=length, seconds=seconds, tokens_per_s=length / seconds, load_mb=load,
                peak_mb=_peak_mb())


def measure(impl: str, length: int, argv: list[str]) -> dict:
    cmd = [sys.executable, "-m", "rag_jax.benchmarks.attention", *argv, "--worker", f"{impl}:{length}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return dict(impl=impl, tokens=length, error=f"exit {proc.returncode}: {' | '.join(tail)[:300]}")
    return json.loads(lines[-1])


def main(argv=None) -> int:
    p = ScriptParser(prog="rag-jax bench attention", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="embedded model name, .gguf file (converted once to an HF folder for both sides) or HF folder")
    p.add_argument("--hf_dir", default=None, help=argparse.SUPPRESS)  # set for the workers
    p.add_argument("--toy", action="store_true", help=f"random 4-layer toy config {TOY} instead of --hf_dir")
    p.add_argument("--kernel", action="store_true",
                   help="time one layer's causal attention alone (the model's head shapes, fp32, random q/k/v); "
                        "the hf row is torch's scaled_dot_product_attention")
    p.add_argument("--sizes", type=int_list(1), default="1024,4096", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--impls", default="dense,blockwise",
                   help="rag_jax attention_impl values, comma-separated")
    p.add_argument("--no_hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--repeats", type=integer(1), default=3, help="timed prefills per worker (median reported)")
    p.add_argument("--rounds", type=integer(1), default=1,
                   help="workers per row, the implementations alternating (a row: the median over rounds)")
    p.add_argument("--threads", type=integer(0), default=0,
                   help="cores: each side pinned (CPU affinity, as taskset) to the same first N cores, JAX and torch alike (0 = unpinned); each worker process binds itself")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="wall: elapsed time; cpu: CPU time of the worker (all threads), which a shared, "
                        "oversubscribed machine does not inflate (use with --threads 1)")
    p.add_argument("--platform", default="cpu", help="JAX platform of the rag_jax rows (JAX_PLATFORMS)")
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        impl, length = args.worker.split(":")
        print(json.dumps(worker(impl, int(length), args)), flush=True)
        return 0
    # Checked here, not at parse time: the workers must not import JAX or resolve models before measuring memory.
    args.impls = p.check("--impls", names(ATTENTION_IMPLS), args.impls)
    if not args.toy:
        p.check("--model", model_source, args.model)
    if args.toy and not args.no_hf and not args.kernel:
        p.error("argument --toy: the toy config has no HF weights; pass --no_hf with --toy")
    with tempfile.TemporaryDirectory() as tmp:
        forwarded = list(argv if argv is not None else sys.argv[1:])
        if not args.toy:
            path = resolve_model(args.model)
            forwarded += ["--hf_dir", str(convert_gguf(path, f"{tmp}/hf") if path.suffix == ".gguf" else path)]
        _run(args, forwarded)
    return 0


def _run(args, forwarded: list[str]) -> list[dict]:
    """Per length, ``--rounds`` rounds of every implementation in turn (so a drift of the machine's speed reaches
    both sides alike); a row is the median over rounds of the workers' medians, its peak the largest."""
    impls = ([] if args.no_hf else ["hf"]) + args.impls
    rows = []
    print(f"{'tokens':>7} {'impl':>10} {'median s':>9} {'tokens/s':>9} {'x hf':>6} {'load MB':>8} {'peak MB':>8} "
          f"{'peak-load MB':>12}", flush=True)
    for length in args.sizes:
        runs = {impl: [] for impl in impls}
        for _ in range(args.rounds):
            for impl in impls:
                runs[impl].append(measure(impl, length, forwarded))
        base = None
        for impl in impls:
            errors = [r for r in runs[impl] if "error" in r]
            if errors:
                rows.append(errors[0])
                print(f"{length:>7} {impl:>10} {errors[0]['error']}", flush=True)
                continue
            seconds = float(np.median([r["seconds"] for r in runs[impl]]))
            row = dict(impl=impl, tokens=length, seconds=seconds, tokens_per_s=length / seconds,
                       load_mb=max(r["load_mb"] for r in runs[impl]), peak_mb=max(r["peak_mb"] for r in runs[impl]),
                       rounds=[r["seconds"] for r in runs[impl]])
            rows.append(row)
            base = row["tokens_per_s"] if impl == "hf" else base
            ratio = f"{row['tokens_per_s'] / base:6.2f}" if base else f"{'-':>6}"
            print(f"{length:>7} {impl:>10} {row['seconds']:9.2f} {row['tokens_per_s']:9.0f} {ratio} "
                  f"{row['load_mb']:8.0f} {row['peak_mb']:8.0f} {row['peak_mb'] - row['load_mb']:12.0f}", flush=True)
        if args.rounds > 1 and base and all("error" not in r for rs in runs.values() for r in rs):
            per_round = [[runs["hf"][i]["seconds"] / runs[impl][i]["seconds"] for i in range(args.rounds)]
                         for impl in args.impls]
            for impl, ratios in zip(args.impls, per_round):
                print(f"{length:>7} {impl:>10} x hf per round: {' '.join(f'{r:.2f}' for r in ratios)}", flush=True)
    return rows


if __name__ == "__main__":  # the per-measurement worker subprocess
    raise SystemExit(main())
