"""Forward and train-step throughput of the rag-jax decoder vs HF transformers (PyTorch) on the same config.

Both run float32 on this machine's CPU (or jax's default backend) with the same architecture
(LlamaForCausalLM), random tokens, full rows, next-token loss and AdamW. Prints medians (tokens/s) and the
ratio rag-jax / torch, both measured in this run.

    rag-jax bench model_vs_torch                       # hidden 256, 4 layers, seq 512, batch 8
    rag-jax bench model_vs_torch --hidden 512 --layers 8 --seq 1024 --iters 10
"""
from __future__ import annotations


import jax
import numpy as np
import optax
import torch
from flax import nnx

from rag_jax import sharding
from rag_jax.benchmarks.train_bench import lm_rows, train_step_seconds
from rag_jax.evaluation.args import ScriptParser, add_model_dims, integer, model_dims, real
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import median_ms
from rag_jax.model import ModelConfig, Transformer


def _median_seconds(fn, warmup: int, iters: int) -> float:
    return median_ms(fn, iters, warmup=warmup) / 1e3


def bench_jax(cfg: ModelConfig, tokens: np.ndarray, lr: float, warmup: int, iters: int) -> tuple[float, float]:
    mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    data = lm_rows(tokens, mesh)
    forward = jax.jit(lambda params, d: nnx.merge(graphdef, params)(
        d["tokens"], d["positions"], d["segment_ids"], mode="causal").logits)
    fwd_s = _median_seconds(lambda: forward(params, data).block_until_ready(), warmup, iters)
    return fwd_s, train_step_seconds(cfg, optax.adamw(lr), mesh, tokens, iters, warmup)


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


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser(prog="rag-jax bench model_vs_torch", description=__doc__)
    add_model_dims(p)
    p.add_argument("--seq", type=integer(1), default=512)
    p.add_argument("--batch", type=integer(1), default=8)
    p.add_argument("--iters", type=integer(1), default=5, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=integer(0), default=2)
    p.add_argument("--lr", type=real(0, lo_open=True), default=1e-4)
    args = p.parse_args(argv)

    cfg = ModelConfig(**model_dims(args), max_seq_len=max(args.seq, 2048))
    tokens = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq)).astype(np.int32)
    n_tokens = args.batch * args.seq
    jax_fwd, jax_step = bench_jax(cfg, tokens, args.lr, args.warmup, args.iters)
    torch_fwd, torch_step = bench_torch(cfg, tokens, args.lr, args.warmup, args.iters)

    print(f"config: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} kv heads, "
          f"vocab {args.vocab}, seq {args.seq}, batch {args.batch}, fp32; jax {jax.__version__} on "
          f"{jax.devices()[0].device_kind}, torch {torch.__version__} ({torch.get_num_threads()} threads); "
          f"median of {args.iters}")
    print(table(["measure", "rag-jax tok/s", "torch tok/s", "jax/torch"],
                [[name, n_tokens / j, n_tokens / t, t / j]
                 for name, j, t in (("forward", jax_fwd, torch_fwd), ("train step (AdamW)", jax_step, torch_step))],
                floatfmt=("", ",.0f", ",.0f", ".2f")))
    return 0
