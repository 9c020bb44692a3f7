"""Chat and text generation with pretrained models, streamed token by token.

``chat_prompt`` renders the model's own Jinja chat template and encodes it by the one prompt rule of
``rag_jax.text`` (the template's markers are special tokens, message contents never are);
``stream_tokens`` is a prefill + per-token decode loop over a fixed KV cache (the steps of ``generate.generate``); ``stream_text`` turns token ids into text
with ``tokenizers``' ``DecodeStream``, which holds back bytes until they form whole UTF-8 characters.
CLI: ``rag-jax chat``, ``rag-jax generate``, ``rag-jax convert`` (``add_subcommands``).
"""
from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from rag_jax.inference.generate import check_sampling, decode_step, prefill, sample_logits
from rag_jax.model.gguf import convert_gguf
from rag_jax.model.load import load_model, resolve_model
from rag_jax.model.transformer import Transformer
from rag_jax.text import chat_encode, chat_pieces, encode_prompt
from rag_jax.tokenizer import eos_tuple

DEFAULT_MODEL = "smollm2-135m-instruct"
PROMPT_BUCKET = 128  # prompts are left-padded to a multiple of this, so one compile serves many prompts


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens"))
def _prefill(graphdef, state, tokens, segment_ids, max_new_tokens):
    positions = jnp.maximum(jnp.cumsum(segment_ids, axis=1) - 1, 0)
    logits, cache, _ = prefill(nnx.merge(graphdef, state), tokens, positions, segment_ids, None, max_new_tokens)
    return logits, cache


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _step(graphdef, state, cache, token, position, slot):
    return decode_step(nnx.merge(graphdef, state), cache, token, position, slot)


def stream_tokens(model: Transformer, prompt: Sequence[int], *, max_new_tokens: int,
                  eos_ids: int | Sequence[int] | None = None, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None, seed: int = 0) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` ids after ``prompt`` (one row), stopping after any id in ``eos_ids``.

    Same tokens as ``generate.generate`` for one prompt (greedy when ``temperature == 0``; else sampling
    with ``temperature``/``top_k``/``top_p``, see ``sample_logits``). Raises ValueError for an empty prompt,
    bad sampling parameters (``check_sampling``) or prompt + ``max_new_tokens`` over ``max_seq_len``.
    """
    cfg = model.config
    eos = eos_tuple(eos_ids)
    check_sampling(max_new_tokens, temperature, top_k, top_p, vocab_size=cfg.vocab_size)
    if not len(prompt):
        raise ValueError("prompt is empty; pass at least one token")
    if len(prompt) + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_seq_len={cfg.max_seq_len}")
    graphdef, state = nnx.split(model)
    width = -(-len(prompt) // PROMPT_BUCKET) * PROMPT_BUCKET
    tokens = np.zeros((1, width), np.int32)
    tokens[0, width - len(prompt):] = prompt
    segment_ids = (np.arange(width) >= width - len(prompt)).astype(np.int32)[None]
    logits, cache = _prefill(graphdef, state, jnp.asarray(tokens), jnp.asarray(segment_ids),
                             max_new_tokens=max_new_tokens)
    rng = jax.random.key(seed)
    for t in range(max_new_tokens):
        rng, step_rng = jax.random.split(rng)
        token = sample_logits(logits, step_rng, temperature=temperature, top_k=top_k, top_p=top_p)
        yield int(token[0])
        if int(token[0]) in eos or t == max_new_tokens - 1:
            return
        logits, cache = _step(graphdef, state, cache, token, jnp.asarray([len(prompt) + t], jnp.int32),
                              jnp.int32(width + t))


def stream_text(tokenizer: Tokenizer, ids: Iterable[int], *, skip_special_tokens: bool = True) -> Iterator[str]:
    """Text pieces as ``ids`` arrive; a piece is only emitted once its bytes form whole UTF-8 characters."""
    decoder = DecodeStream(skip_special_tokens=skip_special_tokens)
    for i in ids:
        piece = decoder.step(tokenizer, i)
        if piece:
            yield piece


def chat_prompt(loaded, messages: Sequence[dict]) -> list[int]:
    """Token ids of ``messages`` under the model's chat template: the template's markers are special tokens,
    each message's content is plain text (``rag_jax.text.chat_encode``). Raises ValueError if it has none."""
    if loaded.chat_template is None:
        raise ValueError(f"model {loaded.source} has no chat template; use `rag-jax generate` for plain text")
    return chat_encode(loaded.tokenizer, loaded.chat_template, messages, **loaded.special_tokens).ids


def user_prompt(loaded, content: str, reply_prefix: str = ""):
    """One user turn as ``rag_jax.text.Encoded``: ``content`` (untrusted text, e.g. a haystack and a question, so
    special-token text in a document stays text) as the user message of the model's chat template,
    or, without one, ``content + "\n"`` after the tokenizer's own prefix (BOS where its post-processor adds
    it, as ``rag-jax generate`` and transformers); then the assistant's ``reply_prefix``."""
    if loaded.chat_template is None:
        return encode_prompt(loaded.tokenizer, [content + "\n", reply_prefix], templated=False)
    pieces = chat_pieces(loaded.chat_template, [{"role": "user", "content": content}], **loaded.special_tokens)
    return encode_prompt(loaded.tokenizer, [*pieces, reply_prefix], templated=True)


def _print_stream(loaded, prompt_ids, args, out) -> str:
    pieces = []
    ids = stream_tokens(loaded.model, prompt_ids, max_new_tokens=args.max_new_tokens, eos_ids=loaded.eos_ids,
                        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    for piece in stream_text(loaded.tokenizer, ids):
        pieces.append(piece)
        out.write(piece)
        out.flush()
    out.write("\n")
    return "".join(pieces)


def _load(args):

    loaded = load_model(args.model, dtype=args.dtype)
    if loaded.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer (tokenizer.json or GGUF tokenizer.ggml.*)")
    return loaded


def _chat(args) -> int:
    loaded = _load(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turns = [args.message] if args.message is not None else None
    while True:
        if turns is not None:
            if not turns:
                return 0
            text = turns.pop(0)
        else:
            try:
                text = input("> ")
            except EOFError:
                return 0
        messages.append({"role": "user", "content": text})
        reply = _print_stream(loaded, chat_prompt(loaded, messages), args, sys.stdout)
        messages.append({"role": "assistant", "content": reply})


def _generate(args) -> int:
    loaded = _load(args)
    ids = encode_prompt(loaded.tokenizer, [args.prompt], templated=False).ids  # BOS as the tokenizer says
    sys.stdout.write(args.prompt)
    _print_stream(loaded, ids, args, sys.stdout)
    return 0


def _convert(args) -> int:

    out = convert_gguf(resolve_model(args.gguf), args.out, dtype=args.dtype or "float32")
    print(f"wrote HF folder {out}")
    return 0


def _sampling_arg(name: str, convert):
    """An argparse type for one sampling parameter, checked by ``check_sampling`` while the command line is
    parsed (before a model loads), so a bad value is a one-line error naming the flag."""
    def parse(text: str):
        value = convert(text)                     # ValueError: argparse's "invalid int value: 'x'"
        try:
            check_sampling(**{"max_new_tokens": 1, name: value})
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value
    parse.__name__ = convert.__name__
    return parse


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Add ``chat``, ``generate`` and ``convert`` to the ``rag-jax`` command line."""
    def model_args(p):
        p.add_argument("--model", default=DEFAULT_MODEL,
                       help=f"embedded model name ({DEFAULT_MODEL}), a .gguf file or an HF folder")
        p.add_argument("--max-new-tokens", type=_sampling_arg("max_new_tokens", int), default=256, help=">= 1")
        p.add_argument("--temperature", type=_sampling_arg("temperature", float), default=0.0,
                       help="finite, >= 0; 0 = greedy")
        p.add_argument("--top-k", type=_sampling_arg("top_k", int), default=None, help=">= 1")
        p.add_argument("--top-p", type=_sampling_arg("top_p", float), default=None, help="in (0, 1]")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])

    chat = sub.add_parser("chat", help="chat with a pretrained model (its chat template; streamed)")
    model_args(chat)
    chat.add_argument("message", nargs="?", default=None,
                      help="one user message to answer (default: read user turns from stdin until EOF)")
    chat.add_argument("--system", default=None, help="system message")
    chat.set_defaults(func=_chat)
    gen = sub.add_parser("generate", help="continue a plain-text prompt with a pretrained model (streamed)")
    model_args(gen)
    gen.add_argument("prompt")
    gen.set_defaults(func=_generate)
    conv = sub.add_parser("convert", help="write a GGUF file (or embedded model name) as an HF safetensors folder")
    conv.add_argument("gguf")
    conv.add_argument("out")
    conv.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    conv.set_defaults(func=_convert)
