"""Train-step throughput (tokens/s) and MFU of the rag-jax train step, per rematerialization policy.

Synthetic full rows (random tokens, one document per row: every position is real work), the project's
jitted, sharded step (AdamW, clipping) over all local devices (FSDP). MFU = model FLOPs/token
(rag_jax.train.metrics: 6 x matmul params + causal attention) x tokens/s / (devices x peak). The peak is
``--peak_flops`` per device, else the data-sheet value for TPUs/GPUs, else (CPU) a dense matmul of the
same dtype measured in this run. Rows are medians; the ratio column is against remat "none" in this run.

    rag-jax bench train_bench                                   # cpu-small, seq 512, batch 8, fp32
    rag-jax bench train_bench --preset llama3.2-1b --seq 4096 --batch 4 --precision bf16 \
        --remat none dots full                                  # the H200 MFU measurement
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from rag_jax import sharding
from rag_jax.args import ScriptParser, integer, real
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import cpu_threads, median_ms
from rag_jax.model import ModelConfig
from rag_jax.model.config import PRECISIONS, PRESETS, apply_precision
from rag_jax.model.transformer import REMAT_POLICIES
from rag_jax.train import metrics as metrics_lib
from rag_jax.train import optim, step as step_lib
from rag_jax.train.objectives import LMLoss


def measured_matmul_flops(dtype: str, n: int = 2048, iters: int = 5) -> float:
    """FLOP/s of an n x n matmul on one device (the CPU 'peak' for MFU)."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    return 2 * n**3 / (median_ms(lambda: f(a).block_until_ready(), iters) / 1e3)


def lm_rows(tokens: np.ndarray, mesh) -> dict[str, jax.Array]:
    """Full causal-LM rows (one document each) for ``tokens`` int32 [batch, seq], batch over the mesh."""
    batch, seq = tokens.shape
    put = lambda x: jax.device_put(x, sharding.batch_sharding(mesh))  # noqa: E731
    return {"tokens": put(tokens), "positions": put(np.tile(np.arange(seq, dtype=np.int32), (batch, 1))),
            "segment_ids": put(np.ones((batch, seq), np.int32))}


def train_step_seconds(cfg: ModelConfig, tx, mesh, tokens: np.ndarray, steps: int, warmup: int,
                       remat: str = "none", trainable: str | None = None) -> float:
    """Median seconds per train step (causal LM loss, ``rag_jax.train.step``) on :func:`lm_rows` of ``tokens``.

    ``trainable``: ``optimizer.trainable`` regex; the others are frozen the way training freezes them (the
    step's stop-gradient mask; ``tx`` should be built with the same regex)."""
    graphdef, state, shardings = step_lib.init_train_state(cfg, tx, mesh, remat_policy=remat)
    mask = optim.trainable_mask(optim.OptimizerConfig(trainable=trainable), state.params)
    train_step = step_lib.make_train_step(graphdef, tx, LMLoss("causal"), shardings, mesh, trainable=mask)
    data, holder = lm_rows(tokens, mesh), {"state": state}

    def one_step():
        holder["state"], metrics = train_step(holder["state"], data)
        jax.block_until_ready(metrics["loss"])
    return median_ms(one_step, steps, warmup=warmup) / 1e3


def bench(cfg: ModelConfig, seq: int, batch: int, remat: str, steps: int, warmup: int, mesh) -> float:
    """Median seconds per train step (AdamW + clipping, random tokens)."""
    tx = optim.make_optimizer(optim.OptimizerConfig(warmup_steps=0), 1000)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    return train_step_seconds(cfg, tx, mesh, tokens, steps, warmup, remat)


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser(prog="rag-jax bench train_bench", description=__doc__)
    p.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS), help="model preset")
    p.add_argument("--seq", type=integer(1), default=512)
    p.add_argument("--batch", type=integer(1), default=8, help="global batch (rows)")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS)
    p.add_argument("--remat", nargs="+", default=["none", "full"], choices=REMAT_POLICIES, help="policies to compare")
    p.add_argument("--steps", type=integer(1), default=5, help="timed steps (median reported)")
    p.add_argument("--warmup", type=integer(0), default=2, help="untimed steps (the first compiles)")
    p.add_argument("--peak_flops", type=real(0, lo_open=True), default=None, help="peak FLOP/s per device for MFU")
    p.add_argument("--threads", type=integer(0), default=0,
                   help="cores: this process pinned (CPU affinity, as taskset) to the first N (0 = unpinned)")
    args = p.parse_args(argv)
    cpu_threads(args.threads)  # before the XLA backend starts

    cfg = apply_precision(ModelConfig.preset(args.preset, max_seq_len=max(args.seq, 2048)), args.precision)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=-1, tensor=1))
    device = jax.devices()[0]
    peak = metrics_lib.peak_flops_per_device(device, args.peak_flops)
    peak_note = "given" if args.peak_flops else "data sheet"
    if peak is None:
        peak = measured_matmul_flops("bfloat16" if args.precision != "fp32" else "float32")
        peak_note = "measured 2048^2 matmul"
    flops_per_token = metrics_lib.train_flops_per_token(cfg, args.seq)
    n_tokens = args.batch * args.seq
    print(f"{args.preset} ({metrics_lib.matmul_params(cfg) / 1e6:.1f}M matmul params), seq {args.seq}, "
          f"batch {args.batch}, {args.precision}; {mesh.size} x {device.device_kind}; "
          f"{flops_per_token / 1e9:.3f} GFLOP/token; peak {peak / 1e12:.2f} TFLOP/s/device ({peak_note}); "
          f"median of {args.steps} steps")
    rows, base = [], None
    for remat in args.remat:
        seconds = bench(cfg, args.seq, args.batch, remat, args.steps, args.warmup, mesh)
        tok_s = n_tokens / seconds
        base = base or tok_s
        mfu = metrics_lib.mfu(tok_s, flops_per_token, mesh.size, peak)
        rows.append([remat, 1e3 * seconds, tok_s, 100 * mfu, tok_s / base])
    print(table(["remat", "step ms", "tokens/s", "MFU %", f"vs {args.remat[0]}"], rows,
                floatfmt=("", ".1f", ",.0f", ".1f", ".2f")))
    return 0
