"""Time to first token: full prefill vs Block-Attention with warm passage caches, and HF prefix caching.

Block-Attention (ICLR 2025, Table 3; research note ``shared/research/block_attention.md`` §1.6): with
every passage block's KV already cached, only the last block (~50 tokens) is prefilled over the
re-encoded caches. For each total prompt length the script times, in one process, medians of
``--repeats`` warm runs:

- ``full``: one causal prefill of the whole prompt (rag_jax), logits of the last token only;
- ``block``: store lookups + re-encoding + prefill of the last block (rag_jax, all caches warm);
- ``hf full`` / ``hf prefix``: HF transformers ``LlamaForCausalLM`` with the same weights, full prefill
  and prefill of the last block over a cached prefix (``DynamicCache``, cropped back after each run):
  the best a user gets there, which works only because the whole prefix is identical; it cannot
  reuse independently cached blocks.

``FLOP bound`` = FLOPs(full prefill) / FLOPs(last block over the cached context): matmul weights
(``rag_jax.train.metrics.matmul_params``, LM head for one row) plus 4·layers·heads·head_dim per
attended (query, key) pair. ``% bound`` = measured speedup / FLOP bound.

    rag-jax bench ttft                                  # small default (1K, 2K), ~1 min on 2 CPU cores
    rag-jax bench ttft --sizes 2048,4096,8192,16384     # the issue's sizes
    rag-jax bench ttft --sizes 2048,4096,8192 --threads 1 --clock cpu   # on a shared, busy machine
    rag-jax bench ttft --preset llama3.2-1b --dtype bfloat16 --sizes 32768 --no_hf   # one H200
    rag-jax bench ttft --model smollm2-135m-instruct --block_len 300 --sizes 1250,3050   # real weights:
        # 4 / 10 passages of 300 tokens + a 50-token question (issue 17 item 2)
    rag-jax bench ttft --model smollm2-135m-instruct --block_len 300 --sizes 3050 --threads 2 --rounds 3
        # the issue-28 row: three rounds of every measurement in turn, per-round ratios printed

Each measurement runs in its own loop (steady state, as a server answering requests of one kind):
interleaving a full prefill, which touches gigabytes, between block prefills slowed the latter by ~1.6x at
4K tokens through memory effects, which is not what a request sees in steady state.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rag_jax.args import ScriptParser, add_model_dims, int_list, integer, model_dims, model_source
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import clock_fn, cpu_threads, median_ms
from rag_jax.inference.block_attention import BlockAttention
from rag_jax.inference.kv_store import KVStore
from rag_jax.model import ModelConfig, Transformer
from rag_jax.model.config import PRESETS
from rag_jax.model.hf import save_hf
from rag_jax.model.load import load_model
from rag_jax.train.metrics import matmul_params


def prefill_flops(cfg: ModelConfig, q_len: int, context: int) -> float:
    """FLOPs to prefill ``q_len`` new tokens after ``context`` cached ones, logits for one row."""
    head = cfg.hidden_size * cfg.vocab_size
    dense = 2.0 * (matmul_params(cfg) - head) * q_len + 2.0 * head
    pairs = q_len * context + q_len * (q_len + 1) / 2
    return dense + 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs


def make_blocks(rng: np.random.Generator, total: int, last_len: int, block_len: int, vocab: int) -> list[list[int]]:
    body = total - last_len
    sizes = [block_len] * (body // block_len) + ([body % block_len] if body % block_len else [])
    return [rng.integers(1, vocab, n).tolist() for n in sizes + [last_len]]


def hf_model(model: Transformer):
    """The same weights as an HF ``LlamaForCausalLM`` (via rag_jax.model.hf.save_hf), fp32, sdpa."""
    import torch
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        save_hf(model, Path(tmp) / "ckpt")
        hf = LlamaForCausalLM.from_pretrained(Path(tmp) / "ckpt", torch_dtype=torch.float32,
                                              attn_implementation="sdpa")
    return hf.eval()


def hf_functions(hf, blocks: list[list[int]]) -> dict:
    """HF full prefill and prefill of the last block over the cached prefix (both: first token id)."""
    import torch
    ids = torch.tensor([[t for b in blocks for t in b]])
    prefix = ids.shape[1] - len(blocks[-1])
    with torch.inference_mode():
        cache = hf(ids[:, :prefix], use_cache=True).past_key_values

    @torch.inference_mode()
    def full():
        return int(hf(ids, use_cache=True, logits_to_keep=1).logits[0, -1].argmax())

    @torch.inference_mode()
    def cached():
        out = hf(ids[:, prefix:], past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.crop(-(ids.shape[1] - prefix))  # drop the last block again (negative: tokens to remove)
        return int(out.logits[0, -1].argmax())
    return {"hf_full": full, "hf_prefix": cached}


def main(argv=None) -> int:
    p = ScriptParser(prog="rag-jax bench ttft", description=__doc__)
    p.add_argument("--sizes", type=int_list(2), default="1024,2048",
                   help="total prompt lengths in tokens, comma-separated")
    p.add_argument("--last_len", type=integer(1), default=50, help="tokens in the last block (instruction + question)")
    p.add_argument("--block_len", type=integer(1), default=256, help="tokens per cached passage block")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="model preset (e.g. llama3.2-1b); default: the dims below")
    p.add_argument("--model", type=model_source, default=None,
                   help="pretrained weights instead of a random model: an embedded name (smollm2-135m-instruct), "
                        "a .gguf file or an HF folder (rag_jax.model.load.load_model); token ids stay random")
    add_model_dims(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=integer(1), default=5, help="timed runs per measurement (median reported)")
    p.add_argument("--rounds", type=integer(1), default=1,
                   help="rounds of every measurement in turn (a drift of the machine's speed reaches all alike); "
                        "a column is the median over rounds, the per-round block / HF prefix ratios are printed")
    p.add_argument("--no_hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--pad_multiple", type=integer(1), default=1,
                   help="BlockAttention shape padding (tokens); 1 = exact lengths (the sizes here are fixed)")
    p.add_argument("--threads", type=integer(0), default=0,
                   help="cores: each side pinned (CPU affinity, as taskset) to the same first N cores, JAX and torch alike (0 = unpinned); 1 gives stable numbers on a busy machine, where thread pools slow down badly "
                        "when oversubscribed")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="wall: elapsed time (TTFT proper); cpu: CPU time of this process (all threads), which "
                        "a shared, oversubscribed machine does not inflate (use with --threads 1)")
    p.add_argument("--seed", type=integer(0), default=0)
    args = p.parse_args(argv)
    clock = clock_fn(args.clock)
    cpu_threads(args.threads)  # read when the XLA backend starts, not at import
    sizes = args.sizes
    if min(sizes) <= args.last_len:
        p.error(f"argument --sizes: every size must exceed --last_len={args.last_len}; got {sizes}")
    dims = dict(dtype=args.dtype, param_dtype=args.dtype, max_seq_len=max(sizes))
    if args.model:
        model = load_model(args.model, dtype=args.dtype).model
        cfg = model.config
        if max(sizes) > cfg.max_seq_len:
            p.error(f"argument --sizes: up to {max(sizes)} exceeds {args.model}'s max_seq_len={cfg.max_seq_len}")
    else:
        if args.preset:
            cfg = ModelConfig.preset(args.preset, **dims)
        else:
            cfg = ModelConfig(**model_dims(args), **dims)
        model = Transformer(cfg, rngs=nnx.Rngs(args.seed))
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    store = KVStore(max_bytes=2 * kv_bytes_per_token * max(sizes) + (1 << 20))
    ba = BlockAttention(model, store=store, fingerprint=f"bench-seed{args.seed}", pad_multiple=args.pad_multiple)
    hf = None
    if not args.no_hf:
        if args.dtype != "float32":
            p.error("the HF baseline runs in float32 on CPU; pass --dtype float32 or --no_hf")
        hf = hf_model(model)
        if args.threads:
            import torch
            torch.set_num_threads(args.threads)
    print(f"backend={jax.default_backend()} devices={jax.device_count()} cpu_cores={os.cpu_count()} "
          f"threads={args.threads or 'default'} clock={args.clock} "
          f"model: {args.model or 'random'} hidden={cfg.hidden_size} layers={cfg.num_layers} heads={cfg.num_heads}/{cfg.num_kv_heads} "
          f"vocab={cfg.vocab_size} dtype={cfg.dtype}; last block {args.last_len} tokens, passage blocks "
          f"{args.block_len} tokens; median of {args.repeats}", flush=True)
    rng = np.random.default_rng(args.seed)
    rows = []
    for total in sizes:
        blocks = make_blocks(rng, total, args.last_len, args.block_len, cfg.vocab_size)

        def run(mode):
            return int(jnp.argmax(ba.prefill(blocks, mode=mode, last_only=True).logits[-1]))

        run("block")  # fills the passage caches (not timed: they are warm in the measured setting)
        hits = store.stats["hits"]
        fns = {"block": lambda: run("block"), "full": lambda: run("full")}
        if hf is not None:
            fns.update(hf_functions(hf, blocks))
        rounds = [{name: median_ms(fn, args.repeats, clock=clock) for name, fn in fns.items()}
                  for _ in range(args.rounds)]
        ms = {name: float(np.median([r[name] for r in rounds])) for name in fns}
        assert store.stats["hits"] - hits == args.rounds * (args.repeats + 1) * (len(blocks) - 1), \
            "caches were not warm"
        if hf is not None and args.rounds > 1:
            print(f"  {total} tokens, block / hf prefix per round: "
                  + ", ".join(f"{r['hf_prefix'] / r['block']:.2f}x ({r['block']:.1f} vs {r['hf_prefix']:.1f} ms)"
                              for r in rounds), flush=True)
        bound = prefill_flops(cfg, total, 0) / prefill_flops(cfg, args.last_len, total - args.last_len)
        row = dict(total=total, blocks=len(blocks), full_ms=ms["full"], block_ms=ms["block"],
                   speedup=ms["full"] / ms["block"], bound=bound)
        if hf is not None:
            row.update(hf_full_ms=ms["hf_full"], hf_prefix_ms=ms["hf_prefix"],
                       hf_speedup=ms["hf_full"] / ms["hf_prefix"], same_first_token=fns["hf_full"]() == run("full"))
        rows.append(row)
        store.clear()
        print(f"  {total} tokens: full {row['full_ms']:.1f} ms, block {row['block_ms']:.1f} ms", flush=True)
    print_table(rows)
    return 0


def print_table(rows: list[dict]) -> None:
    cols = ["total", "blocks", "full ms", "block ms", "speedup", "FLOP bound", "% bound"]
    hf_cols = ["hf full ms", "hf prefix ms", "hf speedup", "block/hf prefix"]
    has_hf = "hf_full_ms" in rows[0]
    out = []
    for r in rows:
        cells = [r["total"], r["blocks"], r["full_ms"], r["block_ms"], f"{r['speedup']:.1f}x", f"{r['bound']:.1f}x",
                 f"{100 * r['speedup'] / r['bound']:.0f}%"]
        if has_hf:
            cells += [r["hf_full_ms"], r["hf_prefix_ms"], f"{r['hf_speedup']:.1f}x",
                      f"{r['hf_prefix_ms'] / r['block_ms']:.2f}x" + ("" if r["same_first_token"] else " (1st token!=)")]
        out.append(cells)
    print(table(cols + (hf_cols if has_hf else []), out, floatfmt=".1f"))
