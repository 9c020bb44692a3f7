"""The one attention-mask builder for every mode (causal LM, bidirectional embedding, Block-Attention).

Keys are the concatenation ``[cached KV segments..., new tokens...]``; a token's *order* is its index
in that concatenation (new tokens come after the cache). ``segment_ids == 0`` marks padding / empty
cache slots on either side.

Modes (``valid = segment_id != 0``):
- ``causal``:        valid_q & valid_k & k_order <= q_order
- ``bidirectional``: valid_q & valid_k & seg_q == seg_k                       (GritLM embedding pass, §2)
- ``block``:         valid_q & valid_k & k_order <= q_order & (seg_q == seg_k | is_global_q)
  Block-Attention (Sun et al., ICLR 2025, §2.2): causal attention inside each block, the last
  (global) block attends to every token before it. Packed training rows are ``block`` with no
  global tokens, so packed examples never see each other.
An optional ``sliding_window`` (Mistral) additionally requires ``q_pos - k_pos < sliding_window``.
"""
from __future__ import annotations

import jax.numpy as jnp

MASK_MODES = ("causal", "bidirectional", "block")


def build_mask(mode: str, q_segment_ids, kv_segment_ids, *, q_is_global=None, q_order=None, kv_order=None,
               q_positions=None, kv_positions=None, sliding_window: int | None = None) -> jnp.ndarray:
    """Boolean attention mask ``[batch, q_len, kv_len]`` (True = may attend).

    Args:
      mode: one of ``MASK_MODES``.
      q_segment_ids: int ``[batch, q_len]``, 0 = padding.
      kv_segment_ids: int ``[batch, kv_len]``, 0 = padding / empty slot.
      q_is_global: bool ``[batch, q_len]`` (block mode), default all False.
      q_order, kv_order: int ``[q_len]`` or ``[batch, q_len]`` / ``[..., kv_len]`` orders; default
        ``kv_order = arange(kv_len)`` and ``q_order = kv_len - q_len + arange(q_len)`` (queries are the
        last ``q_len`` keys, after any cache).
      q_positions, kv_positions: int positions, needed only with ``sliding_window``.
      sliding_window: window in tokens or None.

    Raises:
      ValueError: unknown mode, or ``sliding_window`` without positions.
    """
    if mode not in MASK_MODES:
        raise ValueError(f"mask mode={mode!r} is not supported; valid: {MASK_MODES}")
    q_len, kv_len = q_segment_ids.shape[-1], kv_segment_ids.shape[-1]
    if kv_order is None:
        kv_order = jnp.arange(kv_len)
    if q_order is None:
        q_order = kv_len - q_len + jnp.arange(q_len)
    q_seg = q_segment_ids[:, :, None]
    kv_seg = kv_segment_ids[:, None, :]
    mask = (q_seg != 0) & (kv_seg != 0)
    if mode == "bidirectional":
        mask &= q_seg == kv_seg
    else:
        q_order = jnp.broadcast_to(q_order, q_segment_ids.shape)[:, :, None]
        kv_order = jnp.broadcast_to(kv_order, kv_segment_ids.shape)[:, None, :]
        mask &= kv_order <= q_order
        if mode == "block":
            same = q_seg == kv_seg
            if q_is_global is not None:
                same |= q_is_global[:, :, None].astype(bool)
            mask &= same
    if sliding_window is not None:
        if q_positions is None or kv_positions is None:
            raise ValueError("sliding_window needs q_positions and kv_positions")
        mask &= (q_positions[:, :, None] - kv_positions[:, None, :]) < sliding_window
    return mask
