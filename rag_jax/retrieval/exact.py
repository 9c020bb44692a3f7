"""Exact inner-product index: JAX matmul + ``top_k``, rows sharded over local devices when large.

The reference every approximate index is measured against, and the index for small stores (EM-LLM
events, tests). Scores are ``queries @ vectors.T`` at ``Precision.HIGHEST`` (float32 on GPU/TPU, not
TF32/bf16 passes). With ``S`` devices the corpus rows are split into ``S`` equal shards
(``NamedSharding`` over a 1-D mesh); each shard takes its local top-k and one small top-k merges the
``S·k`` candidates, so only ``[q, S·k]`` values leave the devices. Ties keep the lower row first,
as one ``top_k`` over all rows would.

Device copies are padded to a capacity bucket (>= 1024 rows, 8 buckets per power of two: at most
12.5% padding) and queries to a power of two, so a growing index recompiles O(log n) times; padded
rows score ``-inf``.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from rag_jax.retrieval.index import VectorIndex, VectorStore
from rag_jax.retrieval.storage import atomic_directory, read_manifest

FORMAT = "rag_jax.exact_index"


def _pow2(n: int, minimum: int) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def _capacity(n: int) -> int:
    n = max(n, 1024)
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


@functools.partial(jax.jit, static_argnames=("k", "num_shards"))
def _sharded_top_k(queries, vectors, num_valid, *, k: int, num_shards: int):
    """queries ``[q, d]``, vectors ``[cap, d]`` (row-sharded), num_valid int32 scalar ->
    (scores float32 ``[q, k]``, rows int32 ``[q, k]``)."""
    scores = jnp.matmul(queries, vectors.T, precision=jax.lax.Precision.HIGHEST)
    cap = vectors.shape[0]
    scores = jnp.where(jnp.arange(cap)[None, :] < num_valid, scores, -jnp.inf)
    per_shard = cap // num_shards
    local_k = min(k, per_shard)
    local_scores, local_rows = jax.lax.top_k(scores.reshape(scores.shape[0], num_shards, per_shard), local_k)
    local_rows = local_rows + (jnp.arange(num_shards) * per_shard)[None, :, None]
    top_scores, pick = jax.lax.top_k(local_scores.reshape(scores.shape[0], -1), k)
    return top_scores, jnp.take_along_axis(local_rows.reshape(scores.shape[0], -1), pick, axis=1)


class ExactIndex(VectorIndex):
    """Exact top-k inner-product search (see module docstring).

    Args:
      dim: vector dimension.
      shard_min_rows: shard rows over ``devices`` once the index holds at least this many vectors
        (a small store fits one device; sharding splits the memory and the matmul of a large one).
      devices: devices to use (default ``jax.local_devices()``: each process of a multi-host job
        searches its own shard, see ``sharded.py``).
    """

    def __init__(self, dim: int, *, shard_min_rows: int = 262_144, devices=None):
        super().__init__(dim)
        if shard_min_rows < 0:
            raise ValueError(f"shard_min_rows={shard_min_rows} must be >= 0")
        self.shard_min_rows = shard_min_rows
        self.devices = list(devices) if devices is not None else jax.local_devices()
        self._device_copy = None  # (vectors on device, ids snapshot, num_shards)

    def _changed(self, vectors, ids, old_rows) -> None:
        self._device_copy = None

    def _deleted(self, removed_rows) -> None:
        self._device_copy = None

    def _on_device(self):
        if self._device_copy is None:
            n = self.store.n
            num_shards = len(self.devices) if n >= self.shard_min_rows else 1
            cap = -(-_capacity(n) // num_shards) * num_shards
            padded = np.zeros((cap, self.dim), np.float32)
            padded[:n] = self.store.vectors
            mesh = jax.make_mesh((num_shards,), ("data",), axis_types=(AxisType.Auto,),
                                 devices=self.devices[:num_shards])
            vectors = jax.device_put(padded, NamedSharding(mesh, P("data", None)))
            self._device_copy = (vectors, self.store.ids.copy(), num_shards, mesh)
        return self._device_copy

    def _search(self, queries, k):
        vectors, ids, num_shards, mesh = self._on_device()
        nq = queries.shape[0]
        padded = np.zeros((_pow2(nq, 8), self.dim), np.float32)
        padded[:nq] = queries
        padded = jax.device_put(padded, NamedSharding(mesh, P()))
        scores, rows = _sharded_top_k(padded, vectors, np.int32(self.store.n), k=k, num_shards=num_shards)
        scores, rows = np.asarray(scores)[:nq], np.asarray(rows)[:nq]
        return scores, ids[rows]

    def save(self, path: str | os.PathLike) -> None:
        """Write ``vectors.npy`` + ``ids.npy`` + manifest atomically (see storage.py)."""
        meta = {"dim": self.dim, "size": len(self), "shard_min_rows": self.shard_min_rows}
        with atomic_directory(path, FORMAT, meta) as tmp:
            np.save(tmp / "vectors.npy", self.store.vectors)
            np.save(tmp / "ids.npy", self.store.ids)

    @classmethod
    def load(cls, path: str | os.PathLike, *, devices=None) -> "ExactIndex":
        """Load a saved index. Raises FileNotFoundError (no directory) or ValueError (corrupt/other format)."""
        path = Path(path)
        meta = read_manifest(path, FORMAT)
        index = cls(meta["dim"], shard_min_rows=meta["shard_min_rows"], devices=devices)
        index.store = _load_store(path, meta)
        return index


def _load_store(path: Path, meta: dict) -> VectorStore:
    """vectors.npy + ids.npy -> VectorStore, checked against ``meta`` (dim, size)."""
    try:
        vectors = np.load(path / "vectors.npy", allow_pickle=False)
        ids = np.load(path / "ids.npy", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"corrupt index directory {path}: {e}") from None
    if vectors.shape != (meta["size"], meta["dim"]) or ids.shape != (meta["size"],) \
            or vectors.dtype != np.float32 or ids.dtype != np.int64:
        raise ValueError(f"corrupt index directory {path}: vectors {vectors.shape} {vectors.dtype} / ids "
                         f"{ids.shape} {ids.dtype} do not match size={meta['size']}, dim={meta['dim']}")
    return VectorStore.from_arrays(vectors, ids)
