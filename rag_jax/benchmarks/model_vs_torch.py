"""Forward and train-step throughput of the rag-jax decoder vs HF transformers (PyTorch) on the same config.

Both run float32 on this machine's CPU (or jax's default backend) with the same architecture
(LlamaForCausalLM), random tokens, full rows, next-token loss and AdamW. Prints medians (tokens/s) and the
ratio rag-jax / torch, both measured in this run. Each side runs in its own process; ``--threads N`` pins
both to the same first N cores (CPU affinity, as ``taskset``: XLA ignores its thread flags) and sets
torch's threads to N; ``--rounds R`` alternates the two processes R times (jax, torch, jax, ...) and
reports the median over rounds, so background load on a shared machine hits both sides alike.

    rag-jax bench model_vs_torch                       # hidden 256, 4 layers, seq 512, batch 8
    rag-jax bench model_vs_torch --hidden 512 --layers 8 --seq 1024 --iters 10
    # SmolLM2-135M dims (8 of its 30 layers), both sides on the same 2 cores
    rag-jax bench model_vs_torch --hidden 576 --intermediate 1536 --layers 8 --heads 9 --kv_heads 3 \
        --vocab 49152 --seq 1024 --batch 4 --iters 5 --threads 2 --rounds 2
    # the same, only the top 4 layers (and the final norm) trained, as Block-Attention / GRIT recipes do
    rag-jax bench model_vs_torch ... --train-top 4

``--train-top K`` trains the top K layers and the final norm: rag-jax through its own path (the train step's
stop-gradient mask and ``optimizer.trainable``, i.e. ``rag_jax.train.optim.make_optimizer``: AdamW + clipping,
the frozen updates zeroed), torch with ``requires_grad=False`` below and AdamW over the trained parameters only.

Measured ratios (with the command, the machine and its load) are in README.md's Results and
``bench/PROFILE.md``, not here.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import jax
import numpy as np
import optax
import torch
from flax import nnx

from rag_jax import sharding
from rag_jax.benchmarks.train_bench import lm_rows, train_step_seconds
from rag_jax.args import ScriptParser, add_model_dims, integer, model_dims, real
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import cpu_threads, median_ms
from rag_jax.model import ModelConfig, Transformer
from rag_jax.train import optim
from rag_jax.train.finetune import top_layers


def _median_seconds(fn, warmup: int, iters: int) -> float:
    return median_ms(fn, iters, warmup=warmup) / 1e3


def bench_jax(cfg: ModelConfig, tokens: np.ndarray, lr: float, warmup: int, iters: int,
              train_top: int = 0) -> tuple[float, float]:
    mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    data = lm_rows(tokens, mesh)
    forward = jax.jit(lambda params, d: nnx.merge(graphdef, params)(
        d["tokens"], d["positions"], d["segment_ids"], mode="causal").logits)
    fwd_s = _median_seconds(lambda: forward(params, data).block_until_ready(), warmup, iters)
    if not train_top:
        return fwd_s, train_step_seconds(cfg, optax.adamw(lr), mesh, tokens, iters, warmup)
    trainable = top_layers(cfg.num_layers, train_top)
    tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=lr, warmup_steps=0, decay="constant",
                                                    trainable=trainable), 1000)
    return fwd_s, train_step_seconds(cfg, tx, mesh, tokens, iters, warmup, trainable=trainable)


def bench_torch(cfg: ModelConfig, tokens: np.ndarray, lr: float, warmup: int, iters: int,
                train_top: int = 0) -> tuple[float, float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                         max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings)
    model = LlamaForCausalLM(hf_cfg).float()
    ids = torch.from_numpy(tokens.astype(np.int64))

    model.eval()

    def forward():
        with torch.no_grad():
            model(input_ids=ids).logits

    fwd_s = _median_seconds(forward, warmup, iters)
    model.train()
    if train_top:
        trained = [*model.model.layers[cfg.num_layers - train_top:], model.model.norm]
        for param in model.parameters():
            param.requires_grad_(False)
        for module in trained:
            module.requires_grad_(True)
        clip = [p for m in trained for p in m.parameters()]
    else:
        clip = list(model.parameters())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)

    def one_step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if train_top:  # rag-jax's top-k path clips the trained parameters' global norm
            torch.nn.utils.clip_grad_norm_(clip, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step_s = _median_seconds(one_step, warmup, iters)
    return fwd_s, step_s


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser(prog="rag-jax bench model_vs_torch", description=__doc__)
    add_model_dims(p)
    p.add_argument("--seq", type=integer(1), default=512)
    p.add_argument("--batch", type=integer(1), default=8)
    p.add_argument("--iters", type=integer(1), default=5, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=integer(0), default=2)
    p.add_argument("--lr", type=real(0, lo_open=True), default=1e-4)
    p.add_argument("--threads", type=integer(0), default=0,
                   help="cores: each side's process pinned to the same first N cores, torch threads N (0 = unpinned)")
    p.add_argument("--rounds", type=integer(1), default=1, help="alternating jax/torch process pairs (median)")
    p.add_argument("--train-top", type=integer(0), default=0,
                   help="train only the top K layers and the final norm, both sides (0 = all parameters)")
    p.add_argument("--side", default=None, choices=["jax", "torch"], help=argparse.SUPPRESS)  # one worker
    args = p.parse_args(argv)
    if args.train_top > args.layers:
        p.error(f"--train-top {args.train_top} must be at most --layers {args.layers}")

    cfg = ModelConfig(**model_dims(args), max_seq_len=max(args.seq, 2048))
    tokens = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq)).astype(np.int32)
    n_tokens = args.batch * args.seq
    if args.side:
        cores = cpu_threads(args.threads)  # before the first JAX computation / torch op
        bench = bench_jax if args.side == "jax" else bench_torch
        fwd, step = bench(cfg, tokens, args.lr, args.warmup, args.iters, args.train_top)
        print(json.dumps(dict(forward=fwd, step=step, cores=cores, torch_threads=torch.get_num_threads())), flush=True)
        return 0
    forwarded = list(argv if argv is not None else sys.argv[1:])
    runs = {"jax": [], "torch": []}
    for _ in range(args.rounds):
        for side in runs:
            proc = subprocess.run([sys.executable, "-m", "rag_jax.benchmarks.model_vs_torch", *forwarded,
                                   "--side", side], capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode or not lines:
                raise RuntimeError(f"{side} worker failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
            runs[side].append(json.loads(lines[-1]))
    med = {side: {k: statistics.median(r[k] for r in rs) for k in ("forward", "step")} for side, rs in runs.items()}

    print(f"config: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} kv heads, "
          f"vocab {args.vocab}, seq {args.seq}, batch {args.batch}, fp32, "
          f"{f'top {args.train_top} layers trained' if args.train_top else 'all parameters trained'}; jax {jax.__version__}, "
          f"torch {torch.__version__} ({runs['torch'][0]['torch_threads']} threads); cores "
          f"{runs['jax'][0]['cores'] or 'unpinned'}; median of {args.iters} iterations, {args.rounds} round(s)")
    print(table(["measure", "rag-jax tok/s", "torch tok/s", "jax/torch"],
                [[name, n_tokens / med["jax"][k], n_tokens / med["torch"][k], med["torch"][k] / med["jax"][k]]
                 for name, k in (("forward", "forward"), ("train step (AdamW)", "step"))],
                floatfmt=("", ",.0f", ",.0f", ".2f")))
    return 0


if __name__ == "__main__":  # the per-side worker subprocess
    raise SystemExit(main())
