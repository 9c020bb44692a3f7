"""Retrieval over a corpus sharded across processes (hosts): local top-k everywhere, one global merge.

Each process indexes its own slice of the corpus (``shard_slice``) in any ``Index`` (exact or
ScaNN). A query batch, identical on every process, is answered by a local top-k, an all-gather of
the ``[processes, q, k]`` candidates (``jax.experimental.multihost_utils.process_allgather``) and
``merge_top_k`` — the one merge function, also used single-process. For an exact index the result
equals one index over the whole corpus: every global top-k member is in its shard's local top-k.

Ordering: decreasing score, ties broken by smaller id (deterministic across shard layouts).
"""
from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from rag_jax.retrieval.index import Index, check_k, check_vectors


def shard_slice(n: int, process_index: int | None = None, process_count: int | None = None) -> slice:
    """Contiguous rows ``[start, stop)`` of an ``n``-row corpus owned by a process (sizes differ by <= 1).

    Defaults to ``jax.process_index()`` / ``jax.process_count()``. Raises ValueError on bad arguments.
    """
    if process_index is None or process_count is None:
        import jax
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if n < 0 or process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"shard_slice(n={n}, process_index={process_index}, process_count={process_count}): need "
                         "n >= 0, process_count >= 1 and 0 <= process_index < process_count")
    base, extra = divmod(n, process_count)
    start = process_index * base + min(process_index, extra)
    return slice(start, start + base + (process_index < extra))


def merge_top_k(scores: Sequence[np.ndarray], ids: Sequence[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Global top-k from per-shard top-k lists.

    Args:
      scores: per shard float32 ``[q, k_i]`` (any widths); padding entries are ``-inf`` with id ``-1``.
      ids: per shard int64 ``[q, k_i]``.
      k: neighbours wanted.

    Returns:
      ``(scores float32 [q, w], ids int64 [q, w])``, ``w = min(k, most real candidates in a row)``, sorted by
      decreasing score then increasing id; rows with fewer real candidates are padded (-inf, -1).

    Raises:
      ValueError: no shards, mismatched shapes, or k < 1.
    """
    k = check_k(k)
    if not scores or len(scores) != len(ids):
        raise ValueError(f"merge_top_k needs one ids array per scores array (got {len(scores)} and {len(ids)})")
    for s, i in zip(scores, ids):
        if s.shape != i.shape or s.ndim != 2 or s.shape[0] != scores[0].shape[0]:
            raise ValueError(f"shard results must be [q, k_i] with matching scores/ids; got {s.shape} and {i.shape}")
    all_scores = np.concatenate([np.asarray(s, np.float32) for s in scores], axis=1)
    all_ids = np.concatenate([np.asarray(i, np.int64) for i in ids], axis=1)
    valid = all_ids >= 0
    # Sort keys: padding last, then score descending, then id ascending.
    order = np.lexsort((all_ids, np.where(valid, -all_scores, np.inf), ~valid), axis=1)
    width = min(k, int(valid.sum(axis=1).max(initial=0)))
    order = order[:, :width]
    top_scores = np.take_along_axis(all_scores, order, axis=1)
    top_ids = np.take_along_axis(all_ids, order, axis=1)
    pad = ~np.take_along_axis(valid, order, axis=1)
    return np.where(pad, -np.inf, top_scores).astype(np.float32), np.where(pad, -1, top_ids)


def _pad_to(scores: np.ndarray, ids: np.ndarray, k: int):
    pad = k - scores.shape[1]
    return (np.pad(scores, ((0, 0), (0, pad)), constant_values=-np.inf),
            np.pad(ids, ((0, 0), (0, pad)), constant_values=-1))


class ShardedIndex:
    """This process's shard of a corpus-wide index; ``search`` returns global results on every process.

    Args:
      local: the ``Index`` over this process's rows (ids must be globally unique).
      allgather: ``x [..] -> [processes, ..]`` across processes; default ``process_allgather`` (JAX
        multi-process; a single process gathers just itself).

    Every process must call ``search`` with the same queries and k (a collective); this is checked.
    """

    def __init__(self, local: Index, allgather: Callable[[np.ndarray], np.ndarray] | None = None):
        self.local = local
        self.dim = local.dim
        if allgather is None:
            from jax.experimental import multihost_utils
            allgather = multihost_utils.process_allgather
        self._allgather = allgather

    def __len__(self) -> int:
        """Rows in this process's shard."""
        return len(self.local)

    def search(self, queries, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Global top-k: ``(scores float32 [q, w], ids int64 [q, w])`` (see ``merge_top_k``).

        Raises:
          ValueError: bad k/queries (checked locally), or processes passed different queries or k.
        """
        # Validated before any collective, identically on every process (none may raise alone).
        k = check_k(k)
        queries = check_vectors(queries, self.dim, name="queries")
        # A collective with mismatched inputs would merge unrelated results silently: compare digests.
        digest = np.array([k, queries.shape[0], zlib.crc32(queries.tobytes()) & 0x7FFFFFFF], np.int32)
        digests = np.asarray(self._allgather(digest))
        if not (digests == digests[0]).all():
            raise ValueError("ShardedIndex.search: processes passed different queries or k "
                             f"(digests {digests.tolist()}); "
                             "every process must search the same batch")
        if len(self.local):
            scores, ids = self.local.search(queries, k)
        else:
            scores = np.zeros((queries.shape[0], 0), np.float32)
            ids = np.zeros((queries.shape[0], 0), np.int64)
        scores, ids = _pad_to(scores, ids, k)
        # int64 ids travel as int32 pairs: JAX arrays are 32-bit unless x64 is enabled.
        all_scores = np.asarray(self._allgather(scores))
        all_ids = np.asarray(self._allgather(ids.view(np.int32))).view(np.int64)
        return merge_top_k(list(all_scores), list(all_ids), k)

    def add(self, vectors, ids) -> None:
        self.local.add(vectors, ids)

    def upsert(self, vectors, ids) -> None:
        self.local.upsert(vectors, ids)

    def delete(self, ids) -> None:
        self.local.delete(ids)

    @staticmethod
    def shard_path(path: str | os.PathLike, process_index: int, process_count: int) -> Path:
        return Path(path) / f"shard-{process_index:05d}-of-{process_count:05d}"

    def save(self, path: str | os.PathLike) -> None:
        """Each process writes its shard to ``path/shard-IIIII-of-NNNNN`` (atomically, see storage.py)."""
        import jax
        self.local.save(self.shard_path(path, jax.process_index(), jax.process_count()))

    @classmethod
    def load(cls, path: str | os.PathLike, index_cls, **kwargs) -> "ShardedIndex":
        """Load this process's shard with ``index_cls.load``.

        Raises:
          FileNotFoundError: no shard for this process / process count (names the expected directory).
        """
        import jax
        shard = cls.shard_path(path, jax.process_index(), jax.process_count())
        if not shard.is_dir():
            raise FileNotFoundError(f"{shard} not found: {path} was not saved by {jax.process_count()} processes")
        return cls(index_cls.load(shard), **kwargs)
