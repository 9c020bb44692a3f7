"""Autoregressive generation: a jitted prefill, then a jitted decode loop over a fixed-size KV cache (two programs:
a long prompt compiles with other CPU options than decoding, ``model.xla_options``).

Prompts of different lengths are left-padded (padding has ``segment_id 0`` and is never attended),
so every row writes its new token into the same cache slot. An optional prefix ``kv_cache``
(Block-Attention passage caches, GritLM doc caches) is attended before the prompt; the prompt's
positions continue after the prefix's last position in each row.
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rag_jax.model.kv import DecodeCache, KVSegment
from rag_jax.model.transformer import Transformer
from rag_jax.model.xla_options import forward_options, jit_by_options
from rag_jax.tokenizer import eos_tuple


def sample_logits(logits, rng, *, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None):
    """Pick next tokens from float32 ``logits [batch, vocab]`` -> int32 ``[batch]``.

    ``temperature == 0`` is greedy (argmax). Otherwise logits are divided by ``temperature``, restricted to
    the ``top_k`` largest and to the smallest set whose probability mass reaches ``top_p`` (nucleus
    sampling, Holtzman et al. 2020; the top token is always kept), then sampled.
    """
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < top_p
        cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def decode_step(model: Transformer, cache: DecodeCache, tokens, positions, slot, attend=None):
    """Run one new token per row and write its KV into ``cache`` at ``slot`` (``Transformer.decode``).

    tokens, positions: int32 ``[batch]``; cache: a fixed-size ``DecodeCache`` whose slot ``slot`` is empty;
    attend: optional per-layer decode attention (``Transformer.decode``).
    Returns ``(logits float32 [batch, vocab], updated cache)``.
    """
    return model.decode(tokens, positions, cache, slot, attend)


def prefill(model: Transformer, tokens, positions, segment_ids, prefix: KVSegment | None, max_new_tokens: int):
    """Prompt forward + a decode cache with ``max_new_tokens`` empty slots after it.

    Returns ``(last logits float32 [batch, vocab], cache DecodeCache, index of the first empty slot)``.
    """
    cfg = model.config
    out = model(tokens, positions, segment_ids, mode="causal", kv_cache=prefix)
    empty = KVSegment.empty(cfg.num_layers, tokens.shape[0], max_new_tokens, cfg.num_kv_heads, cfg.head_dim,
                            out.kv.k.dtype)
    cache = KVSegment.concat(([prefix.replace(k=prefix.k.astype(out.kv.k.dtype), v=prefix.v.astype(out.kv.v.dtype))]
                              if prefix is not None else []) + [out.kv, empty])
    return out.logits[:, -1], DecodeCache.from_segment(cache, model.inv_freq), cache.length - max_new_tokens


def _prefill_program(graphdef, state, tokens, segment_ids, positions, prefix, *, max_new_tokens):
    logits, cache, _ = prefill(nnx.merge(graphdef, state), tokens, positions, segment_ids, prefix, max_new_tokens)
    return logits, cache


_prefill_jit = jit_by_options(_prefill_program, static_argnames=("graphdef", "max_new_tokens"))


@functools.partial(jax.jit, static_argnames=("graphdef", "first_slot", "max_new_tokens", "eos_id", "temperature",
                                             "top_k", "top_p", "decode_attention"))
def _decode_loop(graphdef, state, logits, cache, last_pos, rng, *, first_slot, max_new_tokens, eos_id, temperature,
                 top_k, top_p, decode_attention=None):
    model = nnx.merge(graphdef, state)
    batch = logits.shape[0]
    attend = None
    if decode_attention is not None:
        attend = functools.partial(decode_attention.attend, decode_attention.prepare(cache, first_slot))
    fill = eos_id[0] if eos_id else 0
    eos = jnp.asarray(eos_id or (-1,), jnp.int32)

    def cond(carry):
        t, _, _, _, done, _, _ = carry
        return (t < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        t, cache, last_logits, last_pos, done, generated, rng = carry
        rng, step_rng = jax.random.split(rng)
        nxt = sample_logits(last_logits, step_rng, temperature=temperature, top_k=top_k, top_p=top_p)
        nxt = jnp.where(done, fill, nxt)
        generated = generated.at[:, t].set(nxt)
        done = done | jnp.isin(nxt, eos)
        pos = last_pos + 1
        logits, cache = decode_step(model, cache, nxt, pos, first_slot + t, attend)
        return t + 1, cache, logits, pos, done, generated, rng

    generated = jnp.full((batch, max_new_tokens), fill, jnp.int32)
    carry = (jnp.int32(0), cache, logits, last_pos, jnp.zeros((batch,), bool), generated, rng)
    return jax.lax.while_loop(cond, body, carry)[5]


PROMPT_MULTIPLE = 32  # prompt widths are padded to a multiple of this (tokens), within max_seq_len


def _left_pad(prompts, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(prompts, (np.ndarray, jnp.ndarray)):
        arr = np.asarray(prompts)
        if arr.ndim != 2:
            raise ValueError(f"prompts array must be [batch, len]; got shape {arr.shape}")
        prompts = arr.tolist()
    if not prompts:
        raise ValueError("prompts is empty; pass at least one prompt")
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
        raise ValueError(f"prompt {lengths.index(0)} is empty; every prompt needs at least one token")
    width = max(lengths)
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    segment_ids = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids = np.asarray(p)
        if ids.dtype.kind not in "iu":
            raise ValueError(f"prompt {i} holds non-integer token ids ({ids.dtype}, e.g. {ids.ravel()[0]!r}); "
                             "token ids must be ints")
        tokens[i, width - len(p):] = ids
        segment_ids[i, width - len(p):] = 1
    return tokens, segment_ids


def check_sampling(max_new_tokens, temperature=0.0, top_k=None, top_p=None, *, vocab_size: int | None = None) -> None:
    """Validate generation parameters before any compute (the CLI calls it before loading a model).

    Raises:
      ValueError naming the parameter: ``max_new_tokens`` not an int >= 1, ``temperature`` not a finite
      number >= 0, ``top_k`` not an int in [1, vocab_size], ``top_p`` not in (0, 1].
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0 = greedy)")
    upper = vocab_size if vocab_size is not None else math.inf
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral)
                              or not 1 <= top_k <= upper):
        bound = "vocab_size" if vocab_size is None else f"vocab_size={vocab_size}"
        raise ValueError(f"top_k={top_k!r} must be an int in [1, {bound}]")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p={top_p!r} must be a number in (0, 1]")


def generate(model: Transformer | tuple, prompts: Sequence[Sequence[int]] | np.ndarray, *, max_new_tokens: int,
             eos_id: int | Sequence[int] | None = None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0, kv_cache: KVSegment | None = None,
             decode_attention=None) -> np.ndarray:
    """Generate ``max_new_tokens`` tokens after each prompt.

    Args:
      model: a ``Transformer`` or its ``(graphdef, state)`` from ``nnx.split``.
      prompts: token-id lists of any lengths (left-padded internally) or an int array ``[batch, len]``.
      max_new_tokens: tokens to generate per row (>= 1).
      eos_id: an id or a sequence of ids (HF ``generation_config.eos_token_id``); a row stops after it emits
        any of them; later slots are filled with the first listed id.
      temperature, top_k, top_p: sampling (``temperature=0`` = greedy); see ``sample_logits``.
      seed: PRNG seed for sampling.
      kv_cache: optional prefix ``KVSegment`` (batch matching the prompts) attended before the prompt;
        prompt positions continue from each row's last prefix position + 1.
      decode_attention: optional hashable policy with ``prepare(cache, prompt_end) -> state`` (once, after
        prefill) and ``attend(state, layer, q, kt, vt, mask)`` (each decode step and layer), replacing exact
        attention over the cache while decoding, e.g. ``magicpig.MagicPIGDecode`` or ``magicpig.TopKDecode``.

    Prompts are left-padded to a multiple of ``PROMPT_MULTIPLE`` tokens (within ``max_seq_len``) with
    never-attended slots, so batches of nearby prompt lengths reuse one compiled decode loop.

    Returns: int32 NumPy ``[batch, max_new_tokens]``.
    Raises: ValueError for empty prompts, token ids outside the vocabulary, bad sampling parameters, or
      prefix + prompt + new tokens longer than ``max_seq_len``.
    """
    graphdef, state = nnx.split(model) if isinstance(model, nnx.Module) else model
    cfg = nnx.merge(graphdef, state).config if isinstance(model, tuple) else model.config
    check_sampling(max_new_tokens, temperature, top_k, top_p, vocab_size=cfg.vocab_size)
    tokens, segment_ids = _left_pad(prompts, pad_id=0)
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= cfg.vocab_size:
        raise ValueError(f"token id {hi if hi >= cfg.vocab_size else lo} is outside the vocabulary "
                         f"[0, vocab_size={cfg.vocab_size})")
    prefix_len = 0 if kv_cache is None else kv_cache.length
    total = prefix_len + tokens.shape[1] + max_new_tokens
    if total > cfg.max_seq_len:
        raise ValueError(f"prefix ({prefix_len}) + prompt ({tokens.shape[1]}) + max_new_tokens ({max_new_tokens}) = "
                         f"{total} tokens exceeds max_seq_len={cfg.max_seq_len}")
    # Left-pad to a multiple of PROMPT_MULTIPLE (never-attended slots, as for ragged rows): prompts of nearby
    # lengths share one compiled decode loop instead of compiling one each.
    width = min(-(-tokens.shape[1] // PROMPT_MULTIPLE) * PROMPT_MULTIPLE, cfg.max_seq_len - prefix_len - max_new_tokens)
    if width > tokens.shape[1]:
        extra = ((0, 0), (width - tokens.shape[1], 0))
        tokens, segment_ids = np.pad(tokens, extra), np.pad(segment_ids, extra)
    start = np.zeros((tokens.shape[0], 1), np.int32)
    if kv_cache is not None:
        if kv_cache.k.shape[1] != tokens.shape[0]:
            raise ValueError(f"kv_cache batch {kv_cache.k.shape[1]} != number of prompts {tokens.shape[0]}")
        valid = np.asarray(kv_cache.segment_ids) != 0
        start = np.where(valid, np.asarray(kv_cache.positions), -1).max(axis=1, keepdims=True) + 1
    positions = np.maximum(np.cumsum(segment_ids, axis=1) - 1, 0) + start
    positions = jnp.asarray(positions, jnp.int32)
    logits, cache = _prefill_jit(forward_options(tokens.size))(
        graphdef, state, jnp.asarray(tokens), jnp.asarray(segment_ids), positions, kv_cache,
        max_new_tokens=max_new_tokens)
    return np.asarray(_decode_loop(graphdef, state, logits, cache, positions[:, -1], jax.random.key(seed),
                                   first_slot=prefix_len + tokens.shape[1], max_new_tokens=max_new_tokens,
                                   eos_id=eos_tuple(eos_id), temperature=float(temperature), top_k=top_k, top_p=top_p,
                                   decode_attention=decode_attention))
