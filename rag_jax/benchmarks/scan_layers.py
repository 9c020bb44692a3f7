"""Scanned vs unrolled decoder layers (``ModelConfig.scan_layers``): train-step compile time and memory by depth,
and step / prefill speed at one width.

Compile rows lower and compile the project's sharded train step (``rag_jax.train.aot.compile_train_step``:
AdamW, clipping, the causal LM loss) on abstract inputs, nothing allocated, for each depth and layout; the ratio
column is scanned / unrolled compile seconds at that depth in this run. ``temp`` is XLA's temporaries
(``memory_analysis``). Speed rows (``--speed``) time a built model: median seconds per train step and prefill
tokens/s, unrolled as the baseline in the same run.

    rag-jax bench scan_layers                                        # depths 8 32 80 at width 128, remat full
    rag-jax bench scan_layers --layers 8 32 --remat none save_qkv_out_mlpwi
    rag-jax bench scan_layers --layers 30 --hidden 576 --intermediate 1536 --heads 9 --kv-heads 3 \\
        --vocab 49152 --seq 1024 --batch 4 --speed --threads 2      # SmolLM2's shape: which layout is faster here
"""
from __future__ import annotations

import json
import time

import jax
import numpy as np
from flax import nnx

from rag_jax import sharding
from rag_jax.atomic import write_text
from rag_jax.args import ScriptParser, integer, output_file
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import cpu_threads, median_ms
from rag_jax.benchmarks.train_bench import train_step_seconds
from rag_jax.model import Transformer
from rag_jax.model.transformer import REMAT_POLICIES, jit_forward
from rag_jax.train import optim
from rag_jax.train import aot
from rag_jax.train.trainer import load_run_config


def run_config(args, layers: int, scan: bool, remat: str):
    """The RunConfig of one row (model width from ``args``, fsdp over every local device)."""
    return load_run_config(None, [
        f"model.vocab_size={args.vocab}", f"model.hidden_size={args.hidden}",
        f"model.intermediate_size={args.intermediate}", f"model.num_layers={layers}", f"model.num_heads={args.heads}",
        f"model.num_kv_heads={args.kv_heads}", f"model.max_seq_len={args.seq}", f"model.scan_layers={str(scan).lower()}",
        "model.attention_impl=blockwise", f"data.seq_len={args.seq}", f"train.global_batch_size={args.batch}",
        f"train.remat_policy={remat}", "train.objective=lm_causal"])


def compile_row(args, layers: int, scan: bool, remat: str) -> dict:
    cfg = run_config(args, layers, scan, remat)
    start = time.perf_counter()
    compiled = aot.compile_train_step(cfg, sharding.make_mesh(cfg.mesh))
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    return {"layers": layers, "layout": "scanned" if scan else "unrolled", "remat": remat,
            "compile_s": seconds, "temp_mb": mem.temp_size_in_bytes / 2**20}


def speed_row(args, layers: int, scan: bool, remat: str) -> dict:

    cfg = run_config(args, layers, scan, remat)
    mesh = sharding.make_mesh(cfg.mesh)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq)).astype(np.int32)
    tx = optim.make_optimizer(optim.OptimizerConfig(warmup_steps=0), 1000)
    step_s = train_step_seconds(cfg.model, tx, mesh, tokens, args.steps, 1, remat)
    fwd = jit_forward(Transformer(cfg.model, rngs=nnx.Rngs(0)))
    one = tokens[:1]
    pos, seg = np.arange(args.seq, dtype=np.int32)[None], np.ones((1, args.seq), np.int32)
    ms = median_ms(lambda: jax.block_until_ready(fwd(one, pos, seg).logits), args.steps, warmup=1)
    return {"layers": layers, "layout": "scanned" if scan else "unrolled", "remat": remat, "step_s": step_s,
            "prefill_tok_s": args.seq / (ms / 1e3)}


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser(prog="rag-jax bench scan_layers", description=__doc__)
    p.add_argument("--layers", type=integer(1), nargs="+", default=[8, 32, 80], help="depths to compile")
    p.add_argument("--remat", nargs="+", default=["full"], choices=REMAT_POLICIES, help="policies to compare")
    p.add_argument("--hidden", type=integer(8), default=128)
    p.add_argument("--intermediate", type=integer(8), default=384)
    p.add_argument("--heads", type=integer(1), default=4)
    p.add_argument("--kv-heads", type=integer(1), default=2)
    p.add_argument("--vocab", type=integer(8), default=1024)
    p.add_argument("--seq", type=integer(8), default=256)
    p.add_argument("--batch", type=integer(1), default=2)
    p.add_argument("--speed", action="store_true", help="also time train steps and prefill (allocates the model)")
    p.add_argument("--steps", type=integer(1), default=3, help="timed repeats of --speed rows (median)")
    p.add_argument("--threads", type=integer(0), default=0,
                   help="cores: this process pinned (CPU affinity, as taskset) to the first N (0 = unpinned)")
    p.add_argument("--out", type=output_file, default=None, help="JSON results")
    args = p.parse_args(argv)
    cpu_threads(args.threads)
    rows = []
    for remat in args.remat:
        for layers in args.layers:
            pair = [compile_row(args, layers, scan, remat) for scan in (False, True)]
            pair[1]["ratio"] = pair[1]["compile_s"] / pair[0]["compile_s"]
            rows += pair
    print(table(["layers", "layout", "remat", "compile s", "temp MB", "scanned / unrolled"],
                [[r["layers"], r["layout"], r["remat"], r["compile_s"], r["temp_mb"],
                  f"{r['ratio']:.2f}x" if "ratio" in r else "baseline"] for r in rows],
                floatfmt=("", "", "", ".1f", ".1f", "")))
    out = {"compile": rows, "devices": jax.device_count(), "backend": jax.default_backend()}
    if args.speed:
        speed = []
        for remat in args.remat:
            for layers in args.layers:
                pair = [speed_row(args, layers, scan, remat) for scan in (False, True)]
                pair[1]["step_ratio"] = pair[0]["step_s"] / pair[1]["step_s"]
                pair[1]["prefill_ratio"] = pair[1]["prefill_tok_s"] / pair[0]["prefill_tok_s"]
                speed += pair
        print(table(["layers", "layout", "remat", "train step s", "prefill tok/s", "scanned speed / unrolled"],
                    [[r["layers"], r["layout"], r["remat"], r["step_s"], r["prefill_tok_s"],
                      f"step {r['step_ratio']:.2f}x, prefill {r['prefill_ratio']:.2f}x" if "step_ratio" in r
                      else "baseline"] for r in speed], floatfmt=("", "", "", ".3f", ",.0f", "")))
        out["speed"] = speed
    if args.out:
        write_text(args.out, json.dumps(out, indent=1))
    return 0
