"""Load time, prefill and decode speed of a pretrained model in rag-jax vs HF transformers (PyTorch), same run.

Loads: the GGUF file (rag-jax ``load_model``: model + tokenizer, dequantization included; transformers
``from_pretrained(gguf_file=...)`` + ``AutoTokenizer``) and the HF folder ``rag-jax convert`` writes from it
(``load_model`` vs ``from_pretrained``). Prefill: one prompt of each length, float32, last-token logits.
Decode: greedy tokens after prompts of ``--decode-prompts`` tokens (``--decode-batch`` rows), (time for 1 + n
tokens - time for 1 token) / n; rag-jax's one-jit ``generate`` and, for one row, the per-token ``stream_tokens``
loop the CLI uses. Medians of ``--iters`` runs.

    rag-jax bench load_and_speed                                    # SmolLM2-135M-Instruct, prefill 1K and 4K
    rag-jax bench load_and_speed --model path/to/model.gguf --lengths 512 2048 --iters 5
    rag-jax bench load_and_speed --lengths 1024 --decode-prompts 128 2048 --decode-batch 8   # RAG-length caches
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from rag_jax.args import ScriptParser, integer, model_source
from rag_jax.evaluation.tables import table
from rag_jax.evaluation.timing import median_ms
from rag_jax.inference.chat import stream_tokens
from rag_jax.inference.generate import generate
from rag_jax.model.gguf import convert_gguf
from rag_jax.model.load import load_model, resolve_model


def median_seconds(fn, iters: int) -> float:
    return median_ms(fn, iters) / 1e3


def _gguf_model(text: str) -> Path:
    """``--model``: an embedded model name or a .gguf file (transformers loads the same file) -> the file."""
    path = resolve_model(model_source(text))
    if path.suffix != ".gguf":
        raise argparse.ArgumentTypeError(f"{text} is not a GGUF model; pass an embedded model name or a .gguf file")
    return path


def main(argv=None) -> int:
    parser = ScriptParser(prog="rag-jax bench load_and_speed", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=_gguf_model, default="smollm2-135m-instruct",
                        help="embedded model name or .gguf file")
    parser.add_argument("--lengths", type=integer(1), nargs="+", default=[1024, 4096], help="prefill lengths (tokens)")
    parser.add_argument("--new-tokens", type=integer(1), default=64, help="decode tokens")
    parser.add_argument("--decode-prompts", type=integer(1), nargs="+", default=[128],
                        help="prompt lengths (tokens) the decode rows run after (a long one: a RAG prompt's cache)")
    parser.add_argument("--decode-batch", type=integer(1), default=1, help="prompts decoded together")
    parser.add_argument("--iters", type=integer(1), default=3)
    args = parser.parse_args(argv)
    path = args.model
    rows = []

    def row(what, ours_s, theirs_s, unit="s"):
        if unit == "s":
            rows.append([what, f"{ours_s:.2f} s", f"{theirs_s:.2f} s", f"{ours_s / theirs_s:.2f}x"])
        else:  # throughputs given as seconds per token
            rows.append([what, f"{1 / ours_s:.0f} tok/s", f"{1 / theirs_s:.0f} tok/s", f"{theirs_s / ours_s:.2f}x"])
        print(" | ".join(rows[-1]), flush=True)  # as measured; the table follows at the end

    def hf_gguf():
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32)
        transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        return model

    row("load GGUF (model + tokenizer)", median_seconds(lambda: load_model(path), args.iters),
        median_seconds(hf_gguf, args.iters))
    with tempfile.TemporaryDirectory() as tmp:
        folder = convert_gguf(path, Path(tmp) / "hf")
        row("load HF folder (model + tokenizer)", median_seconds(lambda: load_model(folder), args.iters),
            median_seconds(lambda: (transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                                    transformers.AutoTokenizer.from_pretrained(folder)), args.iters))
    ours = load_model(path)
    hf = hf_gguf().eval()
    rng = np.random.default_rng(0)
    vocab = ours.config.vocab_size

    graphdef, state = nnx.split(ours.model)

    @jax.jit
    def last_logits(state, ids):
        pos = jnp.arange(ids.shape[1])[None]
        return nnx.merge(graphdef, state)(ids, pos, jnp.ones_like(ids)).logits[:, -1]

    for length in args.lengths:
        ids = rng.integers(0, vocab, (1, length))
        ours_s = median_seconds(lambda: last_logits(state, jnp.asarray(ids)).block_until_ready(), args.iters)
        with torch.no_grad():
            theirs_s = median_seconds(lambda: hf(torch.tensor(ids), logits_to_keep=1), args.iters)
        row(f"prefill {length} tokens", ours_s / length, theirs_s / length, unit="tok")

    n = args.new_tokens
    for length in args.decode_prompts:
        prompt = rng.integers(0, vocab, (args.decode_batch, length))

        def ours_generate(k, prompt=prompt):
            return lambda: generate(ours.model, prompt, max_new_tokens=k)

        def ours_stream(k, prompt=prompt):
            return lambda: list(stream_tokens(ours.model, prompt[0].tolist(), max_new_tokens=k))

        def hf_generate(k, prompt=prompt):
            def run():
                with torch.no_grad():
                    hf.generate(torch.tensor(prompt), max_new_tokens=k, min_new_tokens=k, do_sample=False)
            return run

        hf_s = (median_seconds(hf_generate(n + 1), args.iters) - median_seconds(hf_generate(1), args.iters)) / n
        makers = [("generate, one jit", ours_generate)] + ([("stream_tokens, CLI", ours_stream)]
                                                           if args.decode_batch == 1 else [])
        for name, make in makers:
            ours_s = (median_seconds(make(n + 1), args.iters) - median_seconds(make(1), args.iters)) / n
            row(f"decode after {length} x {args.decode_batch} ({name})", ours_s / args.decode_batch,
                hf_s / args.decode_batch, unit="tok")
    print(f"model: {path.name}; jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), transformers {transformers.__version__}; float32; "
          f"medians of {args.iters}")
    print(table(["", "rag-jax", "transformers", "ratio (time: rag-jax/hf; speed: rag-jax/hf)"], rows))
    return 0
