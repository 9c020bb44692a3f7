"""Where the question looks: per layer, the attention mass the last block's queries put on each block's keys.

Block-Attention (Ma, Wang, Lan, ICLR 2025, §2.2) encodes each passage block on its own and lets only the last
block (the question and the template tail) attend across blocks. In block mode the passage keys of every layer
above the first were computed without the other passages, so the question may read them differently. This
diagnostic runs one prompt through the model's own layers (``DecoderLayer.qkv`` / ``finish``, the model's
attention for the layer outputs) and records, per layer, the joint softmax weight of the last block's tokens summed
over each block's keys, averaged over those tokens and all heads (``attention.key_mass``). Positions are
contiguous in both modes, as after Block-Attention's RoPE re-encoding, so the block-mode forward here equals the
block-cache inference path.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rag_jax.model.attention import attend_joint, key_mass
from rag_jax.model.masks import MaskSpec
from rag_jax.model.rope import rope_angles, rotate

MODES = ("full", "block")
PAD_TO = 256  # prompt length bucket (tokens)


def block_layout(blocks: Sequence[Sequence[int]]):
    """``(tokens, positions, segment_ids, is_global)`` int32 / bool ``[1, total]``: block ``i`` has segment ``i + 1``,
    the last block is global. Raises ValueError for fewer than 2 blocks or an empty one."""
    if len(blocks) < 2 or any(len(b) == 0 for b in blocks):
        raise ValueError(f"blocks: need at least 2 non-empty token blocks (got lengths {[len(b) for b in blocks]})")
    tokens = np.concatenate([np.asarray(b, np.int32) for b in blocks])[None]
    seg = np.concatenate([np.full(len(b), i + 1, np.int32) for i, b in enumerate(blocks)])[None]
    return tokens, np.arange(tokens.shape[1], dtype=np.int32)[None], seg, seg == len(blocks)


def block_attention_mass(model, blocks: Sequence[Sequence[int]], mode: str, lead: int | None = None) -> np.ndarray:
    """Per layer, the last block's attention mass on each block (module docstring).

    Args:
      model: an unscanned ``Transformer`` without sliding windows.
      blocks: token id lists; the last one holds the queries measured (it attends to everything before it).
      mode: ``"full"`` (causal attention over the concatenation) or ``"block"`` (each block attends within
        itself, the last block to all).
      lead: count only each block's first ``lead`` tokens (None: all of them). In block mode a block's first
        tokens are where a separately encoded block grows an attention sink of its own (``block_prefix``).

    Returns:
      float64 ``[num_layers, len(blocks)]``; with ``lead=None`` each row sums to 1 (the last block's own keys
      included).

    Raises:
      ValueError: an unknown ``mode``, ``lead`` < 1, a scanned or windowed model, or bad ``blocks``, before any
      compute.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not supported; valid: {MODES}")
    if lead is not None and lead < 1:
        raise ValueError(f"lead={lead} must be at least 1 token (or None for whole blocks)")
    cfg = model.config
    if cfg.scan_layers or cfg.sliding_window is not None:
        raise ValueError("block_attention_mass needs an unscanned model without sliding windows "
                         f"(scan_layers={cfg.scan_layers}, sliding_window={cfg.sliding_window})")
    tokens, positions, seg, is_global = block_layout(blocks)
    total = tokens.shape[1]
    offset = np.concatenate([np.arange(len(b)) for b in blocks])              # token index within its block
    counted = np.pad((offset < (lead or total)).astype(np.float32), (0, -total % PAD_TO))
    pad = -total % PAD_TO                       # padding keys / queries (segment 0) keep the compiled shapes few
    tokens, positions, seg, is_global = (np.pad(x, ((0, 0), (0, pad))) for x in (tokens, positions, seg, is_global))
    queries = -(-(len(blocks[-1]) + pad) // 64) * 64   # the trailing queries measured (the last block's, padded)
    graphdef, state = nnx.split(model)
    masses, _ = _masses(graphdef, state, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(seg),
                        jnp.asarray(is_global), mode, len(blocks), min(queries, total + pad), jnp.asarray(counted))
    return np.asarray(masses, np.float64)


@functools.partial(jax.jit, static_argnames=("graphdef", "mode", "num_blocks", "queries"))
def _masses(graphdef, state, tokens, positions, seg, is_global, mode, num_blocks, queries, counted=None):
    model = nnx.merge(graphdef, state)
    spec = (MaskSpec.create("causal", seg, seg) if mode == "full" else
            MaskSpec.create("block", seg, seg, q_is_global=is_global))
    tail = spec.replace(**{f: getattr(spec, f)[:, -queries:] for f in
                           ("q_segment_ids", "q_order", "q_positions", "q_is_global")})
    rope = rope_angles(positions, model.inv_freq)
    weights = (seg[:, -queries:] == num_blocks).astype(jnp.float32)
    weights = (weights / weights.sum())[:, None]                               # [1, 1, queries]
    onehot = jax.nn.one_hot(seg[0] - 1, num_blocks, dtype=jnp.float32)        # [total, blocks]; padding: 0
    if counted is not None:                                                     # [total]: 1 for the keys counted
        onehot = onehot * counted[:, None]
    x, rows = model.embed(tokens), []
    for layer in model.layers:
        q, k, v = layer.qkv(x)
        q, k = rotate(q, *rope), rotate(k, *rope)
        out, lse = attend_joint([(q, k, v, spec)], return_lse=True, impl=model.config.attention_impl)
        mass = key_mass(q[:, -queries:], k, tail, lse[..., -queries:], weights)[0, 0]   # [heads, total]
        rows.append(mass.mean(0) @ onehot)
        x = layer.finish(x, out)
    return jnp.stack(rows), x                  # x: the residual after the last layer (tests)


CATEGORIES = ("instruction", "gold passage", "other passages", "question")


def categorize(masses: np.ndarray, gold: int) -> dict[str, np.ndarray]:
    """``block_attention_mass`` rows ``[layers, blocks]`` of a RAG prompt (block 0 = template head + instruction,
    passages, the question block last) with the gold passage at block ``gold`` -> per ``CATEGORIES`` entry the
    per-layer mass ``[layers]``. Raises ValueError when ``gold`` is not a passage block."""
    n = masses.shape[1]
    if not 0 < gold < n - 1:
        raise ValueError(f"gold={gold} must index a passage block, 1..{n - 2}")
    return {"instruction": masses[:, 0], "gold passage": masses[:, gold],
            "other passages": masses[:, 1:n - 1].sum(1) - masses[:, gold], "question": masses[:, n - 1]}
