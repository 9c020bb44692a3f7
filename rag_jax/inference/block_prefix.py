"""Block-Attention with a shared prefix: passage blocks encoded after one common prefix (issue 29, item 2).

In block mode (Ma, Wang, Lan, ICLR 2025, §2.3) each passage block is encoded alone from local position 0, so
its first token plays the part of a sequence start: every block grows its own attention sink, and the last
block attends to as many sinks as there are blocks, which full attention never shows it. APE (Yang et al.,
ICLR 2025, "APE: Faster and Longer Context-Augmented Generation via Adaptive Parallel Encoding", §3) encodes
every context after one **shared prefix** instead, so all blocks share the prefix's sink. Here the prefix is
the first ``P`` tokens of block 0 (``PREFIXES``: ``none`` P = 0, plain block mode; ``sink`` P = 1, the chat
template's first token, "one shared sink"; ``system`` all of block 0, the template's start and system turn;
``nosink`` P = 0 with each passage's first token, its own sink, hidden from the last block, so the question's
sink mass goes back to block 0's: training-free only):
each passage block is encoded causally after the prefix's KV at local positions ``P..P+n-1``; the last block
attends to block 0, then to each passage's KV re-encoded to its offset in the prompt (keys are pre-RoPE), exactly
as ``inference.block_attention.BlockAttention`` assembles cached blocks (its ``prefix`` option). A passage's KV
then depends on the prefix, which is fixed per deployment (the template's start), so it stays reusable across
questions and positions.

``prefix_block_residuals`` is that computation as one batched, jittable and differentiable function of a model
(token ids or a frozen bottom's outputs as input), which Block-Attention distillation trains through
(``rag_jax.recipes.block_attention.distill``): training and inference then see the same attention by construction.
``block_parts`` lays ``BlockExample``s out for it; ``block_logprobs`` scores one example with it.
"""
from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rag_jax.model import KVSegment

PREFIXES = ("none", "sink", "system", "nosink")
HIDDEN_SEGMENT = 2  # block_parts' passage segment id of a token seen by its own passage only ("nosink")
PART_KEYS = ("head_tokens", "head_segment_ids", "passage_tokens", "passage_segment_ids", "passage_positions",
             "tail_tokens", "tail_segment_ids", "tail_positions", "prefix_len")


def prefix_length(prefix: str, block0_len: int) -> int:
    """Tokens of block 0 every passage block sees under ``prefix`` (``PREFIXES``). Raises ValueError otherwise."""
    if prefix not in PREFIXES:
        raise ValueError(f"prefix={prefix!r}; valid: {', '.join(PREFIXES)}")
    return {"none": 0, "sink": min(1, block0_len), "system": block0_len, "nosink": 0}[prefix]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket_length(n: int, multiple: int) -> int:
    """``n`` tokens rounded up to a multiple of ``multiple`` and of 1/8 of the largest power of two <= ``n``: at
    most 12.5% padding above ``8 * multiple`` tokens, eight compiled shapes per doubling of length (1,300 -> 1,408
    with ``multiple`` 16). The one padding rule of Block-Attention caches, passages and distillation batches."""
    return _round_up(n, max(multiple, (1 << max(n.bit_length() - 1, 0)) // 8))


def part_shapes(examples, multiple: int = 16) -> dict[str, int]:
    """``{head_len, num_passages, passage_len, tail_len}``: the smallest padded widths (multiples of
    ``multiple``; passages unpadded in number) that hold every example's block 0, passages and last block +
    response."""
    return {"head_len": _round_up(max(len(ex.blocks[0]) for ex in examples), multiple),
            "num_passages": max(max(len(ex.blocks) - 2 for ex in examples), 1),
            "passage_len": _round_up(max([len(b) for ex in examples for b in ex.blocks[1:-1]] or [1]), multiple),
            "tail_len": _round_up(max(len(ex.blocks[-1]) + len(ex.response) for ex in examples), multiple)}


def block_parts(examples, prefix: str, shapes: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """The ``prefix_block_residuals`` layout of ``BlockExample``s (B = ``len(examples)``), right-padded to
    ``shapes`` (default ``part_shapes(examples)``); padding has segment id 0 and is never attended:

      ``head_tokens``/``head_segment_ids`` int32 ``[B, head_len]``: block 0 (positions 0..);
      ``passage_tokens``/``passage_segment_ids``/``passage_positions`` int32 ``[B, num_passages, passage_len]``:
        the passage blocks and their positions in the whole prompt (all-padding rows for missing passages); with
        ``nosink`` each passage's first token has segment id ``HIDDEN_SEGMENT`` (hidden from the last block);
      ``tail_tokens``/``tail_segment_ids``/``tail_positions`` int32 ``[B, tail_len]``: last block + response;
      ``prefix_len`` int32 ``[B]``: ``prefix_length(prefix, len(block 0))``.

    Raises:
      ValueError: unknown prefix, an example with fewer than 2 blocks, or one that does not fit ``shapes``.
    """
    for i, ex in enumerate(examples):
        if len(ex.blocks) < 2:
            raise ValueError(f"example {i} has {len(ex.blocks)} block(s); block 0 and a last block are needed")
    s = part_shapes(examples) if shapes is None else shapes
    b, n, wp = len(examples), s["num_passages"], s["passage_len"]
    out = {"head_tokens": np.zeros((b, s["head_len"]), np.int32), "passage_tokens": np.zeros((b, n, wp), np.int32),
           "passage_positions": np.zeros((b, n, wp), np.int32), "tail_tokens": np.zeros((b, s["tail_len"]), np.int32),
           "tail_positions": np.zeros((b, s["tail_len"]), np.int32), "prefix_len": np.zeros(b, np.int32)}
    out["head_segment_ids"] = np.zeros_like(out["head_tokens"])
    out["passage_segment_ids"] = np.zeros_like(out["passage_tokens"])
    out["tail_segment_ids"] = np.zeros_like(out["tail_tokens"])
    for i, ex in enumerate(examples):
        head, passages, tail = ex.blocks[0], ex.blocks[1:-1], list(ex.blocks[-1]) + list(ex.response)
        if (len(head) > s["head_len"] or len(passages) > n or len(tail) > s["tail_len"]
                or any(len(p) > wp for p in passages)):
            raise ValueError(f"example {i} (block 0 {len(head)}, passages {[len(p) for p in passages]}, last block "
                             f"+ response {len(tail)} tokens) does not fit the part shapes {s}")
        out["head_tokens"][i, :len(head)], out["head_segment_ids"][i, :len(head)] = head, 1
        offset = len(head)
        for j, p in enumerate(passages):
            out["passage_tokens"][i, j, :len(p)], out["passage_segment_ids"][i, j, :len(p)] = p, 1
            if prefix == "nosink":
                out["passage_segment_ids"][i, j, 0] = HIDDEN_SEGMENT
            out["passage_positions"][i, j, :len(p)] = offset + np.arange(len(p))
            offset += len(p)
        out["tail_tokens"][i, :len(tail)], out["tail_segment_ids"][i, :len(tail)] = tail, 1
        out["tail_positions"][i, :len(tail)] = offset + np.arange(len(tail))
        out["prefix_len"][i] = prefix_length(prefix, len(head))
    return out


def prefix_block_residuals(model, parts: dict, embeds: tuple | None = None):
    """The residual streams (before the final norm) of block 0, the passages and the tail of a batch of prompts in
    shared-prefix block mode (module docstring): ``(head_x [B, head_len, hidden], passage_x [B, N, passage_len,
    hidden], tail_x [B, tail_len, hidden])`` in the compute dtype.

    Args:
      model: a ``Transformer`` (e.g. a ``frozen_bottom`` top, with ``embeds``).
      parts: ``block_parts``' arrays (NumPy or JAX).
      embeds: None (token embeddings) or ``(head, passage, tail)`` inputs of the first layer shaped as the three
        outputs (a frozen bottom's outputs of this function).
    """
    head_tok, head_seg = jnp.asarray(parts["head_tokens"]), jnp.asarray(parts["head_segment_ids"])
    p_tok, p_seg = jnp.asarray(parts["passage_tokens"]), jnp.asarray(parts["passage_segment_ids"])
    b, n, wp = p_tok.shape
    wh = head_tok.shape[1]
    prefix_len = jnp.asarray(parts["prefix_len"], jnp.int32)
    head_emb, p_emb, tail_emb = (None, None, None) if embeds is None else embeds
    head_pos = jnp.where(head_seg > 0, jnp.arange(wh, dtype=jnp.int32), 0)
    head_x, head_kv = model.encode(head_tok, head_pos, head_seg, inputs_embeds=head_emb)
    # Every passage sees block 0's first prefix_len tokens, then itself, at local positions prefix_len.. .
    seen = jnp.where(jnp.arange(wh)[None] < prefix_len[:, None], head_kv.segment_ids, 0)
    prefix = KVSegment(k=jnp.repeat(head_kv.k, n, axis=1), v=jnp.repeat(head_kv.v, n, axis=1),
                       positions=jnp.repeat(head_kv.positions, n, axis=0), segment_ids=jnp.repeat(seen, n, axis=0))
    local = jnp.where(p_seg > 0, prefix_len[:, None, None] + jnp.arange(wp, dtype=jnp.int32), 0)
    p_x, p_kv = model.encode(p_tok.reshape(b * n, wp), local.reshape(b * n, wp), p_seg.reshape(b * n, wp),
                             kv_cache=prefix, inputs_embeds=None if p_emb is None else p_emb.reshape(b * n, wp, -1))
    layers, _, _, heads, dim = p_kv.k.shape
    passages = KVSegment(k=p_kv.k.reshape(layers, b, n * wp, heads, dim),
                         v=p_kv.v.reshape(layers, b, n * wp, heads, dim),
                         positions=jnp.asarray(parts["passage_positions"], jnp.int32).reshape(b, n * wp),
                         segment_ids=jnp.where(p_seg == HIDDEN_SEGMENT, 0, p_seg).reshape(b, n * wp))
    tail_x, _ = model.encode(jnp.asarray(parts["tail_tokens"]), jnp.asarray(parts["tail_positions"]),
                             jnp.asarray(parts["tail_segment_ids"]), kv_cache=KVSegment.concat([head_kv, passages]),
                             inputs_embeds=tail_emb)
    return head_x, p_x.reshape(b, n, wp, -1), tail_x


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _tail_logp(graphdef, state, parts):
    model = nnx.merge(graphdef, state)
    tail_x = prefix_block_residuals(model, parts)[2]
    logp = jax.nn.log_softmax(model.logits(model.final_norm(tail_x)), axis=-1)
    nxt = jnp.concatenate([parts["tail_tokens"][:, 1:], parts["tail_tokens"][:, :1]], axis=1)
    return jnp.take_along_axis(logp, nxt[:, :, None], axis=-1)[..., 0]


def block_logprobs(model, example, *, prefix: str = "none") -> np.ndarray:
    """float32 ``[g]``: log p(next token) at every position of the last block and the response of ``example`` but
    the final one (the targets of ``rag_jax.recipes.block_attention.distill``), with the passage blocks encoded after
    ``prefix`` (``PREFIXES``; module docstring).

    Args:
      model: a ``Transformer`` (or its ``(graphdef, state)``).
      example: a ``rag_jax.data.block_rag.BlockExample`` (block 0, passages, last block; response).

    Raises:
      ValueError: unknown ``prefix``, or an example with fewer than 2 blocks.
    """
    graphdef, state = nnx.split(model) if isinstance(model, nnx.Module) else model
    parts = block_parts([example], prefix)
    g = len(example.blocks[-1]) + len(example.response) - 1
    return np.asarray(_tail_logp(graphdef, state, parts))[0, :g]
