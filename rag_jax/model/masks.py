"""The one attention-mask definition for every mode (causal LM, bidirectional embedding, Block-Attention).

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

The mask stays *structural* (``MaskSpec``: per-token vectors, O(seq) memory) down to the attention
kernel; ``MaskSpec.allowed`` evaluates the predicate above on any (query slice, key slice) pair, so the
dense reference (``MaskSpec.dense`` / ``build_mask``) and the blockwise kernel's chunks share one
definition. ``MaskSpec.chunk_classes`` classifies (query chunk, key chunk) tiles from per-chunk bounds so a
kernel skips tiles the structure masks out entirely and drops the mask on tiles it allows entirely (a
conservative test: it may keep an all-masked tile or mask a full one, never the reverse).
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

MASK_MODES = ("causal", "bidirectional", "block")
_BIG = jnp.iinfo(jnp.int32).max // 2
SKIP, PARTIAL, FULL = 0, 1, 2  # tile classes of MaskSpec.chunk_classes


@flax.struct.dataclass
class MaskSpec:
    """Structural attention mask: everything is ``[batch, len]`` (``len`` = q_len or kv_len).

    Build with ``MaskSpec.create``. Attributes: ``q_segment_ids``/``kv_segment_ids`` int32 (0 = padding),
    ``q_order``/``kv_order`` int32 orders, ``q_positions``/``kv_positions`` int32 RoPE positions (used
    only with a window), ``q_is_global`` bool; static ``mode`` and ``sliding_window`` (tokens or None).
    """

    q_segment_ids: jax.Array
    kv_segment_ids: jax.Array
    q_order: jax.Array
    kv_order: jax.Array
    q_positions: jax.Array
    kv_positions: jax.Array
    q_is_global: jax.Array
    mode: str = flax.struct.field(pytree_node=False, default="causal")
    sliding_window: int | None = flax.struct.field(pytree_node=False, default=None)

    @classmethod
    def create(cls, mode: str, q_segment_ids, kv_segment_ids, *, q_is_global=None, q_order=None, kv_order=None,
               q_positions=None, kv_positions=None, sliding_window: int | None = None) -> "MaskSpec":
        """Normalize the ``build_mask`` arguments (see there) into a spec; nothing ``[q, kv]`` is built.

        Raises:
          ValueError: unknown mode, ``sliding_window`` without positions, or a window < 1.
        """
        if mode not in MASK_MODES:
            raise ValueError(f"mask mode={mode!r} is not supported; valid: {MASK_MODES}")
        if sliding_window is not None:
            if q_positions is None or kv_positions is None:
                raise ValueError("sliding_window needs q_positions and kv_positions")
            if sliding_window < 1:
                raise ValueError(f"sliding_window={sliding_window} must be None or >= 1 tokens")
        q_segment_ids = jnp.asarray(q_segment_ids, jnp.int32)
        kv_segment_ids = jnp.asarray(kv_segment_ids, jnp.int32)
        q_shape, kv_shape = q_segment_ids.shape, kv_segment_ids.shape
        q_len, kv_len = q_shape[-1], kv_shape[-1]
        if kv_order is None:
            kv_order = jnp.arange(kv_len)
        if q_order is None:
            q_order = kv_len - q_len + jnp.arange(q_len)
        if q_positions is None:
            q_positions, kv_positions = q_order, kv_order
        if q_is_global is None:
            q_is_global = jnp.zeros(q_shape, bool)

        def fit(x, shape, dtype=jnp.int32):
            return jnp.broadcast_to(jnp.asarray(x).astype(dtype), shape)

        return cls(q_segment_ids, kv_segment_ids, fit(q_order, q_shape), fit(kv_order, kv_shape),
                   fit(q_positions, q_shape), fit(kv_positions, kv_shape), fit(q_is_global, q_shape, bool),
                   mode=mode, sliding_window=sliding_window)

    @property
    def q_len(self) -> int:
        return self.q_segment_ids.shape[-1]

    @property
    def kv_len(self) -> int:
        return self.kv_segment_ids.shape[-1]

    def q_fields(self):
        return self.q_segment_ids, self.q_order, self.q_positions, self.q_is_global

    def kv_fields(self):
        return self.kv_segment_ids, self.kv_order, self.kv_positions

    def allowed(self, q_fields, kv_fields) -> jax.Array:
        """The mask predicate on a query slice and a key slice: ``q_fields`` = (segment_ids, order,
        positions, is_global) each ``[batch, qc]``, ``kv_fields`` = (segment_ids, order, positions) each
        ``[batch, kc]`` -> bool ``[batch, qc, kc]``. The single definition of the semantics."""
        q_seg, q_order, q_pos, q_glob = (x[:, :, None] for x in q_fields)
        kv_seg, kv_order, kv_pos = (x[:, None, :] for x in kv_fields)
        mask = (q_seg != 0) & (kv_seg != 0)
        if self.mode == "bidirectional":
            mask &= q_seg == kv_seg
        else:
            mask &= kv_order <= q_order
            if self.mode == "block":
                mask &= (q_seg == kv_seg) | q_glob
        if self.sliding_window is not None:
            mask &= (q_pos - kv_pos) < self.sliding_window
        return mask

    def dense(self) -> jax.Array:
        """Boolean mask ``[batch, q_len, kv_len]`` (True = may attend): the dense reference path only."""
        return self.allowed(self.q_fields(), self.kv_fields())

    def pad(self, q_len: int, kv_len: int) -> "MaskSpec":
        """The same spec with queries / keys padded (segment id 0, never attended) to the given lengths."""
        def pad_to(x, n):
            return jnp.pad(x, ((0, 0), (0, n - x.shape[-1])))
        return self.replace(q_segment_ids=pad_to(self.q_segment_ids, q_len), q_order=pad_to(self.q_order, q_len),
                            q_positions=pad_to(self.q_positions, q_len), q_is_global=pad_to(self.q_is_global, q_len),
                            kv_segment_ids=pad_to(self.kv_segment_ids, kv_len),
                            kv_order=pad_to(self.kv_order, kv_len), kv_positions=pad_to(self.kv_positions, kv_len))

    def chunk_classes(self, q_chunk: int, kv_chunk: int) -> jax.Array:
        """int32 ``[q_len // q_chunk, kv_len // kv_chunk]`` per (query chunk, key chunk) tile, over all batch
        rows (lengths must be chunk multiples; see ``pad``): ``SKIP`` (0) the structure masks every pair,
        ``PARTIAL`` (1) evaluate ``allowed`` on the tile, ``FULL`` (2) every pair is allowed.

        Conservative per-chunk bounds of the same predicate: a tile is SKIP only if some term (validity,
        order, segment range or global flag, window) fails for every pair, FULL only if every term holds
        for every pair; anything else is PARTIAL."""
        def stats(seg, order, pos, chunk):
            b = seg.shape[0]
            valid = (seg != 0).reshape(b, -1, chunk)

            def lo_hi(x):
                x = x.reshape(b, -1, chunk)
                return jnp.where(valid, x, _BIG).min(-1), jnp.where(valid, x, -_BIG).max(-1)
            return valid.any(-1), valid.all(-1), lo_hi(seg), lo_hi(order), lo_hi(pos)

        q_any, q_all, (qs_lo, qs_hi), (qo_lo, qo_hi), (qp_lo, qp_hi) = stats(
            self.q_segment_ids, self.q_order, self.q_positions, q_chunk)
        k_any, k_all, (ks_lo, ks_hi), (ko_lo, ko_hi), (kp_lo, kp_hi) = stats(
            self.kv_segment_ids, self.kv_order, self.kv_positions, kv_chunk)
        q_, k_ = (lambda x: x[:, :, None]), (lambda x: x[:, None, :])
        some = q_(q_any) & k_(k_any)        # [batch, nq, nk]: a pair of the tile may be allowed
        every = q_(q_all) & k_(k_all)       # [batch, nq, nk]: every pair of the tile is allowed
        overlap = (q_(qs_lo) <= k_(ks_hi)) & (k_(ks_lo) <= q_(qs_hi))
        one_segment = (q_(qs_lo) == q_(qs_hi)) & (q_(qs_hi) == k_(ks_lo)) & (k_(ks_lo) == k_(ks_hi))
        if self.mode == "bidirectional":
            some &= overlap
            every &= one_segment
        else:
            some &= k_(ko_lo) <= q_(qo_hi)
            every &= k_(ko_hi) <= q_(qo_lo)
            if self.mode == "block":
                glob = self.q_is_global.reshape(self.q_is_global.shape[0], -1, q_chunk)
                valid_glob = glob & (self.q_segment_ids != 0).reshape(glob.shape)
                some &= overlap | q_(valid_glob.any(-1))
                every &= one_segment | q_(glob.all(-1))
        if self.sliding_window is not None:
            some &= (q_(qp_lo) - k_(kp_hi)) < self.sliding_window
            every &= (q_(qp_hi) - k_(kp_lo)) < self.sliding_window
        return jnp.where(every.all(0), FULL, jnp.where(some.any(0), PARTIAL, SKIP)).astype(jnp.int32)


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
    return MaskSpec.create(mode, q_segment_ids, kv_segment_ids, q_is_global=q_is_global, q_order=q_order,
                           kv_order=kv_order, q_positions=q_positions, kv_positions=kv_positions,
                           sliding_window=sliding_window).dense()
