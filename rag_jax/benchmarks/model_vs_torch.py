"""Forward and train-step throughput of the rag-jax decoder vs HF transformers (PyTorch) on the same config.

Both run float32 on this machine's CPU (or jax's default backend) with the same architecture
(LlamaForCausalLM), random tokens, full rows, next-token loss and AdamW. Prints medians (tokens/s) and the
ratio rag-jax / torch, both measured in this run.

    python bench/model_vs_torch.py                       # hidden 256, 4 layers, seq 512, batch 8
    python bench/model_vs_torch.py --hidden 512 --layers 8 --seq 1024 --iters 10
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
import optax
import torch
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from rag_jax import sharding
from rag_jax.model import ModelConfig
from rag_jax.train import step as step_lib
from rag_jax.train.objectives import LMLoss


def _median_seconds(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_jax(cfg: ModelConfig, tokens: np.ndarray, lr: float, warmup: int, iters: int) -> tuple[float, float]:
    batch, seq = tokens.shape
    mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
    tx = optax.adamw(lr)
    graphdef, state, shardings = step_lib.init_train_state(cfg, tx, mesh, seed=0)
    rep = NamedSharding(mesh, P())
    data = {"tokens": jax.device_put(tokens, rep),
            "positions": jax.device_put(np.tile(np.arange(seq, dtype=np.int32), (batch, 1)), rep),
            "segment_ids": jax.device_put(np.ones((batch, seq), np.int32), rep)}

    forward = jax.jit(lambda params, d: nnx.merge(graphdef, params)(
        d["tokens"], d["positions"], d["segment_ids"], mode="causal").logits)
    fwd_s = _median_seconds(lambda: forward(state.params, data).block_until_ready(), warmup, iters)

    train_step = step_lib.make_train_step(graphdef, tx, LMLoss("causal"), shardings, mesh)
    holder = {"state": state}

    def one_step():
        holder["state"], metrics = train_step(holder["state"], data)
        jax.block_until_ready(metrics["loss"])

    step_s = _median_seconds(one_step, warmup, iters)
    return fwd_s, step_s


def bench_torch(cfg: ModelConfig, tokens: np.ndarray, lr: float, warmup: int, iters: int) -> tuple[float, float]:
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
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def one_step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step_s = _median_seconds(one_step, warmup, iters)
    return fwd_s, step_s


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=5, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    args = p.parse_args(argv)

    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                      max_seq_len=max(args.seq, 2048))
    tokens = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq)).astype(np.int32)
    n_tokens = args.batch * args.seq
    jax_fwd, jax_step = bench_jax(cfg, tokens, args.lr, args.warmup, args.iters)
    torch_fwd, torch_step = bench_torch(cfg, tokens, args.lr, args.warmup, args.iters)

    print(f"config: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} kv heads, "
          f"vocab {args.vocab}, seq {args.seq}, batch {args.batch}, fp32; jax {jax.__version__} on "
          f"{jax.devices()[0].device_kind}, torch {torch.__version__} ({torch.get_num_threads()} threads); "
          f"median of {args.iters}")
    print(f"| {'measure':<22} | {'rag-jax tok/s':>14} | {'torch tok/s':>12} | {'jax/torch':>9} |")
    print(f"|{'-' * 24}|{'-' * 16}|{'-' * 14}|{'-' * 11}|")
    for name, j, t in (("forward", jax_fwd, torch_fwd), ("train step (AdamW)", jax_step, torch_step)):
        print(f"| {name:<22} | {n_tokens / j:>14,.0f} | {n_tokens / t:>12,.0f} | {t / j:>9.2f} |")


if __name__ == "__main__":
    main()
