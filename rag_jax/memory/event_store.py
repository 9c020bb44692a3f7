"""Event memory: host-resident event KV, representative vectors in a retrieval index, a bounded device cache.

EM-LLM (Fountas et al., ICLR 2025, §3.3) inherits InfLLM's memory units: each event keeps its pre-RoPE keys and
values (all layers; boundaries are shared by the layers) in host memory, and one *representative vector* per
layer, searched by inner product with the chunk's mean query (research note ``em_llm.md`` §4.1-4.3):

- ``representative_vectors``: for every query head, the mean of the keys of the ``repr_topk`` tokens that
  received the most attention while inside the local window; concatenated over query heads
  (``num_heads * head_dim``; query heads of one KV group may pick different tokens, so this is not reducible to
  the KV heads, note §4.2);
- ``EventStore``: the host store plus one index per layer (``rag_jax.retrieval``: exact for small stores,
  ScaNN for large ones);
- ``DeviceEventCache``: a fixed number of ``max_block_size``-token slots per layer on the device, least
  recently used slots reused (the reference's ``CudaCache``), so device memory does not grow with the stream.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable

import einops
import jax
import jax.numpy as jnp
import numpy as np

from rag_jax.memory.config import EMLLMConfig
from rag_jax.memory.index import EventIndex


def representative_vectors(keys: jnp.ndarray, scores: jnp.ndarray, size, repr_topk: int) -> jnp.ndarray:
    """Representative vector of one event per layer.

    Args:
      keys: ``[num_layers, max_len, num_kv_heads, head_dim]`` pre-RoPE keys of the event (first ``size`` valid).
      scores: float32 ``[num_layers, num_heads, max_len]`` attention mass each token received in the local window.
      size: number of valid tokens (int or traced int32 scalar), >= 1.
      repr_topk: representative tokens per query head (fewer if the event is shorter).

    Returns:
      float32 ``[num_layers, num_heads * head_dim]``: per query head the mean key of its top-scored tokens.
    """
    num_heads, max_len = scores.shape[1], scores.shape[2]
    valid = jnp.arange(max_len) < size
    masked = jnp.where(valid, scores.astype(jnp.float32), -jnp.inf)
    k = min(repr_topk, max_len)
    top_scores, top_idx = jax.lax.top_k(masked, k)                      # [L, H, k]
    use = jnp.isfinite(top_scores).astype(jnp.float32)                  # events shorter than k
    group = num_heads // keys.shape[2]
    keys_h = einops.repeat(keys.astype(jnp.float32), "l t h d -> l (h g) t d", g=group)
    picked = jnp.take_along_axis(keys_h, top_idx[..., None], axis=2)    # [L, H, k, d]
    mean = (picked * use[..., None]).sum(2) / jnp.maximum(use.sum(-1), 1.0)[..., None]
    return einops.rearrange(mean, "l h d -> l (h d)")


class EventStore:
    """Events of one stream in host memory.

    Per event: ``start`` (stream position of its first token), ``size`` (tokens), keys and values
    ``[num_layers, size, num_kv_heads, head_dim]`` (numpy, model dtype), and one representative vector per layer
    in ``indexes[layer]``.
    """

    def __init__(self, num_layers: int, repr_dim: int, cfg: EMLLMConfig,
                 index_factory: Callable[[str, int], object] | None = None):
        self.num_layers = num_layers
        self.starts: list[int] = []
        self.sizes: list[int] = []
        self._k: list[np.ndarray] = []
        self._v: list[np.ndarray] = []
        self.indexes = [EventIndex(repr_dim, cfg.index, index_factory)
                        for _ in range(num_layers)]

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.sizes))

    @property
    def nbytes(self) -> int:
        """Host bytes of event KV and representative vectors."""
        return int(sum(k.nbytes + v.nbytes for k, v in zip(self._k, self._v))
                   + sum(ix.nbytes for ix in self.indexes))

    def add(self, starts: list[int], k: list[np.ndarray], v: list[np.ndarray], repr_vectors: np.ndarray
            ) -> list[int]:
        """Store events (in stream order): ``k[i]``/``v[i]`` ``[num_layers, size_i, kv_heads, head_dim]``,
        ``repr_vectors`` ``[num_events, num_layers, repr_dim]``. Returns their ids (numbered in stream order)."""
        first = len(self.sizes)
        for start, ki, vi in zip(starts, k, v, strict=True):
            if ki.shape[0] != self.num_layers or ki.shape != vi.shape or ki.shape[1] < 1:
                raise ValueError(f"event k/v shapes {ki.shape}/{vi.shape} must be [num_layers={self.num_layers}, "
                                 "size>=1, kv_heads, head_dim]")
            self.starts.append(int(start))
            self.sizes.append(int(ki.shape[1]))
            self._k.append(ki)
            self._v.append(vi)
        for layer, index in enumerate(self.indexes):
            index.add(repr_vectors[:, layer], first)
        return list(range(first, len(self.sizes)))

    def kv(self, event_id: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Host keys/values ``[size, kv_heads, head_dim]`` of one event in one layer."""
        return self._k[event_id][layer], self._v[event_id][layer]

    def rank(self, layer: int, query: np.ndarray, k: int) -> np.ndarray:
        """Ids of the ``k`` events of ``layer`` most similar to ``query`` (``[repr_dim]``), best first."""
        return self.indexes[layer].search(query, min(k, len(self.sizes)))


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _write_slots(cache_k, cache_v, slots, k, v):
    """``cache[slots[i]] = k[i]`` (and v); slots past the end (padding) are dropped."""
    return cache_k.at[slots].set(k, mode="drop"), cache_v.at[slots].set(v, mode="drop")


class DeviceEventCache:
    """Per-layer device slots holding event KV: ``k[layer]``/``v[layer]`` ``[slots, max_block_size, kv_heads,
    head_dim]``. Events not resident are copied from the host store into the least recently used slot."""

    def __init__(self, num_layers: int, slots: int, max_block_size: int, num_kv_heads: int, head_dim: int, dtype):
        shape = (slots, max_block_size, num_kv_heads, head_dim)
        self.k = [jnp.zeros(shape, dtype) for _ in range(num_layers)]
        self.v = [jnp.zeros(shape, dtype) for _ in range(num_layers)]
        self.slots = slots
        self.max_block_size = max_block_size
        self._resident: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(num_layers)]
        self.loads = 0

    def load(self, layer: int, event_ids: list[int], store: EventStore) -> np.ndarray:
        """Make ``event_ids`` resident in ``layer`` (most recently used); returns their slots (int32 ``[n]``).

        Raises:
          ValueError: more events than slots.
        """
        if len(event_ids) > self.slots:
            raise ValueError(f"{len(event_ids)} events requested but the device cache has {self.slots} slots per "
                             "layer; raise EMLLMConfig.max_cached_events")
        resident = self._resident[layer]
        wanted = set(event_ids)
        slots = np.empty(len(event_ids), np.int32)
        free = [s for s in range(self.slots) if s not in set(resident.values())]
        missing = []
        for i, event_id in enumerate(event_ids):
            if event_id in resident:
                resident.move_to_end(event_id)
                slots[i] = resident[event_id]
                continue
            if free:
                slot = free.pop()
            else:
                victim = next(e for e in resident if e not in wanted)
                slot = resident.pop(victim)
            resident[event_id] = slot
            slots[i] = slot
            missing.append((slot, event_id))
        if missing:
            self._write(layer, missing, store)
        return slots

    def _write(self, layer: int, missing: list[tuple[int, int]], store: EventStore) -> None:
        """Copy events ``(slot, event_id)`` from the host store in one transfer and one dispatch (the batch is
        padded to a power of two so that few shapes compile)."""
        shape = self.k[layer].shape
        batch = 1 << (len(missing) - 1).bit_length()
        k = np.zeros((batch, *shape[1:]), self.k[layer].dtype)
        v = np.zeros_like(k)
        slots = np.full(batch, self.slots, np.int32)
        for i, (slot, event_id) in enumerate(missing):
            ek, ev = store.kv(event_id, layer)
            k[i, :len(ek)], v[i, :len(ev)] = ek, ev
            slots[i] = slot
        self.k[layer], self.v[layer] = _write_slots(self.k[layer], self.v[layer], slots, k, v)
        self.loads += len(missing)

    @property
    def nbytes(self) -> int:
        return int(sum(x.nbytes for x in self.k + self.v))
