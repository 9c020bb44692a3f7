"""KV segments: cached keys (pre-RoPE) and values of earlier tokens, attended by later queries.

Block-Attention passage caches, GritLM doc caches, EM-LLM memory and prompts are ``KVSegment``s. Keys are
kept *before* RoPE so a segment can be attended at any offset exactly: re-encoding is
``seg.with_positions(seg.positions + offset)`` (Block-Attention §2.3, ``k = R(o)·k̃``).

Token-by-token decoding reads the same keys hundreds of times at fixed positions, so it keeps them in a
``DecodeCache``: rotated once, heads first, one fixed-size array per layer that each step writes in place.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from rag_jax.model.rope import rope_angles, rotate


HOST_CONCAT_BYTES = 1 << 20  # smaller concatenations stay in XLA (a host copy saves nothing there)


def concatenate(arrays, axis: int) -> jax.Array:
    """``jnp.concatenate(arrays, axis)``; on a CPU backend with one device (the result is committed to it, where
    XLA's would follow its inputs: with several devices that would differ), for concrete arrays, a NumPy copy into a
    64-byte-aligned buffer that JAX then reads without a copy (``jnp.from_dlpack``).

    XLA:CPU's concatenate copies well below memcpy's rate (``bench/PROFILE.md``), and Block-Attention assembles
    every request's cache this way. Traced arrays, other devices, sharded arrays, dtypes outside NumPy's own
    (bfloat16) and concatenations under ``HOST_CONCAT_BYTES`` take the XLA path; both give the same values.
    ``arrays``: a non-empty sequence; their shapes must agree off ``axis`` (else ValueError or TypeError).
    """
    arrays = list(arrays)
    first = arrays[0]
    host = (jax.default_backend() == "cpu" and jax.device_count() == 1 and np.dtype(first.dtype).isbuiltin == 1
            and all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.dtype == first.dtype
                    for x in arrays)
            and sum(x.nbytes for x in arrays) >= HOST_CONCAT_BYTES)
    if not host:
        return jnp.concatenate(arrays, axis=axis)
    shape = list(first.shape)
    shape[axis] = sum(x.shape[axis] for x in arrays)
    size, itemsize = int(np.prod(shape)), np.dtype(first.dtype).itemsize
    raw = np.empty(size * itemsize + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start:start + size * itemsize].view(first.dtype).reshape(shape)
    np.concatenate([np.asarray(x) for x in arrays], axis=axis, out=out)
    return jnp.from_dlpack(out)


@flax.struct.dataclass
class KVSegment:
    """Per-layer cached keys and values of ``length`` tokens (a pytree).

    Attributes:
      k: ``[num_layers, batch, length, num_kv_heads, head_dim]`` keys before RoPE.
      v: ``[num_layers, batch, length, num_kv_heads, head_dim]`` values.
      positions: int32 ``[batch, length]`` RoPE positions the keys are rotated to when attended.
      segment_ids: int32 ``[batch, length]``; 0 marks an empty slot / padding (never attended).
    """

    k: jnp.ndarray
    v: jnp.ndarray
    positions: jnp.ndarray
    segment_ids: jnp.ndarray

    @property
    def length(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays of this segment."""
        return int(sum(x.size * x.dtype.itemsize for x in (self.k, self.v, self.positions, self.segment_ids)))

    def with_positions(self, positions) -> "KVSegment":
        """The same keys attended at new RoPE ``positions`` (exact re-encoding: keys are pre-RoPE)."""
        return self.replace(positions=jnp.broadcast_to(jnp.asarray(positions, jnp.int32), self.positions.shape))

    def with_segment_ids(self, segment_ids) -> "KVSegment":
        return self.replace(
            segment_ids=jnp.broadcast_to(jnp.asarray(segment_ids, jnp.int32), self.segment_ids.shape))

    def slice(self, start: int, stop: int) -> "KVSegment":
        """Tokens ``[start, stop)`` of this segment (e.g. dropping bucket padding)."""
        return KVSegment(k=self.k[:, :, start:stop], v=self.v[:, :, start:stop],
                         positions=self.positions[:, start:stop], segment_ids=self.segment_ids[:, start:stop])

    @staticmethod
    def concat(segments: "list[KVSegment]") -> "KVSegment":
        """Concatenate segments along the token axis (attention order = list order)."""
        if not segments:
            raise ValueError("KVSegment.concat needs at least one segment")
        if len(segments) == 1:
            return segments[0]
        return KVSegment(
            k=concatenate([s.k for s in segments], axis=2),
            v=concatenate([s.v for s in segments], axis=2),
            positions=jnp.concatenate([s.positions for s in segments], axis=1),
            segment_ids=jnp.concatenate([s.segment_ids for s in segments], axis=1),
        )

    @staticmethod
    def empty(num_layers: int, batch: int, length: int, num_kv_heads: int, head_dim: int,
              dtype=jnp.float32) -> "KVSegment":
        """An all-empty segment (segment_ids 0), e.g. a fixed-size decode cache."""
        shape = (num_layers, batch, length, num_kv_heads, head_dim)
        return KVSegment(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                         positions=jnp.zeros((batch, length), jnp.int32),
                         segment_ids=jnp.zeros((batch, length), jnp.int32))


@flax.struct.dataclass
class DecodeCache:
    """A fixed-size decoding cache (a pytree): keys after RoPE, heads before tokens, one array per layer.

    Attributes:
      k: tuple of ``num_layers`` arrays ``[batch, num_kv_heads, length, head_dim]``, keys rotated to their
        ``positions``.
      v: tuple of ``num_layers`` arrays ``[batch, num_kv_heads, length, head_dim]``, values.
      positions: int32 ``[batch, length]``.
      segment_ids: int32 ``[batch, length]``; 0 marks an empty slot (never attended).

    A decode step (``Transformer.decode``) writes one slot of every layer and attends the cache as stored: no
    per-step concatenation, transpose or re-rotation of the cached keys, which with pre-RoPE ``KVSegment`` keys
    cost more than the step's matmuls at RAG-length caches.
    """

    k: tuple
    v: tuple
    positions: jnp.ndarray
    segment_ids: jnp.ndarray

    @property
    def length(self) -> int:
        return self.k[0].shape[2]

    @staticmethod
    def from_segment(segment: KVSegment, inv_freq) -> "DecodeCache":
        """``segment``'s keys rotated to its positions (``rope.rotate``, as attention rotates them) and both
        moved heads-first; ``inv_freq`` the model's ``rope_inv_freq``."""
        cos, sin = rope_angles(segment.positions, inv_freq)
        layers = range(segment.k.shape[0])
        return DecodeCache(k=tuple(jnp.swapaxes(rotate(segment.k[i], cos, sin), 1, 2) for i in layers),
                           v=tuple(jnp.swapaxes(segment.v[i], 1, 2) for i in layers),
                           positions=segment.positions, segment_ids=segment.segment_ids)

    def write(self, layer: int, k, v, slot) -> tuple[jnp.ndarray, jnp.ndarray]:
        """Layer ``layer``'s keys and values with rotated ``k`` / ``v [batch, s, num_kv_heads, head_dim]`` written
        at token slots ``slot .. slot + s - 1`` (``slot`` an int32 scalar); returns the two updated arrays."""
        def put(cache, x):
            return jax.lax.dynamic_update_slice_in_dim(cache, jnp.swapaxes(x, 1, 2).astype(cache.dtype), slot, axis=2)
        return put(self.k[layer], k), put(self.v[layer], v)
