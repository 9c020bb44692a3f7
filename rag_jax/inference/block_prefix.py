"""Block-Attention with a shared prefix: a training-free correction of block mode (issue 29, item 2).

In block mode (Ma, Wang, Lan, ICLR 2025, §2.3) each passage block is encoded alone from local position 0, so
its first token plays the part of a sequence start: every block grows its own attention sink, and the last
block attends to as many sinks as there are blocks, which full attention never shows it. APE (Yang et al.,
ICLR 2025, "APE: Faster and Longer Context-Augmented Generation via Adaptive Parallel Encoding", §3) encodes
every context after one **shared prefix** instead, so all blocks share the prefix's sink. Here the prefix is
the first ``shared_prefix`` tokens of block 0 (the chat template's start and system turn; 1 = only the first
token, "one shared sink"): each passage block is encoded causally after the prefix's KV at positions
``P..P+n-1`` and cached; the last block attends to block 0, then to each passage's KV re-encoded to its offset
in the prompt (keys are pre-RoPE, as in ``inference.block_attention``), exactly as Block-Attention assembles
them. ``shared_prefix=0`` is plain block mode. A passage's cache then depends on the prefix, which is fixed per
deployment (the system turn), so passage KV stays reusable across questions.

``block_logprobs`` scores a ``BlockExample`` this way: the log-probability of the next token at every position
of the last block and the response but the final one (the targets of ``rag_jax.train.block_distill``), for the
paired log-likelihood evaluation.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rag_jax.model import KVSegment


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _encode(graphdef, state, tokens, positions, segment_ids, kv_cache):
    return nnx.merge(graphdef, state)(tokens, positions, segment_ids, mode="causal", kv_cache=kv_cache).kv


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _next_logp(graphdef, state, tokens, positions, segment_ids, kv_cache, index):
    model = nnx.merge(graphdef, state)
    hidden = model(tokens, positions, segment_ids, mode="causal", kv_cache=kv_cache).hidden
    logp = jax.nn.log_softmax(model.logits(jnp.take_along_axis(hidden, index[:, :, None], axis=1)), axis=-1)
    nxt = jnp.take_along_axis(tokens, jnp.minimum(index + 1, tokens.shape[1] - 1), axis=1)
    return jnp.take_along_axis(logp, nxt[:, :, None], axis=-1)[0, :, 0]


def _pad(ids, width: int, start: int):
    """int32 ``[1, width]`` tokens, positions ``start..``, segment ids (1 real, 0 padding) of ``ids``."""
    n = len(ids)
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :n] = ids
    seg = (np.arange(width) < n).astype(np.int32)[None]
    return tokens, np.where(seg > 0, start + np.arange(width), 0).astype(np.int32), seg


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def block_logprobs(model, example, *, shared_prefix: int = 0) -> np.ndarray:
    """float32 ``[g]``: log p(next token) at every position of the last block and the response of ``example`` but
    the final one, when its passage blocks are encoded after the first ``shared_prefix`` tokens of block 0
    (module docstring).

    Args:
      model: a ``Transformer`` (or its ``(graphdef, state)``).
      example: a ``rag_jax.data.block_rag.BlockExample`` (block 0, passages, last block; response).
      shared_prefix: prefix tokens of block 0 every passage sees; 0 = plain block mode.

    Raises:
      ValueError: ``shared_prefix`` outside ``[0, len(block 0)]``, or an example with fewer than 2 blocks.
    """
    graphdef, state = nnx.split(model) if isinstance(model, nnx.Module) else model
    blocks = [list(b) for b in example.blocks]
    if len(blocks) < 2:
        raise ValueError(f"example has {len(blocks)} block(s); block 0 and a last block are needed")
    if not 0 <= shared_prefix <= len(blocks[0]):
        raise ValueError(f"shared_prefix={shared_prefix} must be in [0, len(block 0)={len(blocks[0])}]")
    prefix = None
    if shared_prefix:
        prefix = _encode(graphdef, state, *_pad(blocks[0][:shared_prefix], shared_prefix, 0), None)
    segments, offset = [], 0
    for i, block in enumerate(blocks[:-1]):
        width = _round_up(len(block), 64)
        cache = prefix if i > 0 else None               # block 0 holds the prefix itself
        start = shared_prefix if cache is not None else 0
        kv = _encode(graphdef, state, *_pad(block, width, start), cache).slice(0, len(block))
        segments.append(kv.with_positions(offset + np.arange(len(block))[None]))
        offset += len(block)
    cache = KVSegment.concat(segments)
    width = _round_up(offset, 256)
    if width > offset:
        c = cache
        cache = KVSegment.concat([c, KVSegment.empty(c.k.shape[0], 1, width - offset, c.k.shape[3], c.k.shape[4],
                                                     c.k.dtype)])
    last = blocks[-1] + list(example.response)
    t = np.arange(len(last) - 1, dtype=np.int32)
    index = np.zeros((1, _round_up(len(t), 16)), np.int32)
    index[0, :len(t)] = t
    logp = _next_logp(graphdef, state, *_pad(last, _round_up(len(last), 32), offset), cache, index)
    return np.asarray(logp)[:len(t)]
