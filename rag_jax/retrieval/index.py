"""The one index interface (top-k inner product over a growing set of vectors) and its shared parts.

``Index`` is the protocol that corpus retrieval and EM-LLM event lookup program against; the
implementations are ``ExactIndex`` (exact.py, JAX matmul + top_k) and ``ScannIndex``
(scann_index.py). ``VectorIndex`` holds what they share: input validation (before anything is
changed) and a host ``VectorStore`` of rows and int64 ids.

Search contract (all implementations): ``search(queries [q, dim], k) -> (scores float32 [q, w],
ids int64 [q, w])`` sorted by decreasing inner product, with ``w = min(k, len(index))``: asking for
more neighbours than the index holds returns what exists. A row with fewer than ``w`` results (an
approximate index that scanned too few points) is padded with id ``-1`` and score ``-inf``.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Index(Protocol):
    dim: int

    def __len__(self) -> int: ...

    def add(self, vectors, ids) -> None: ...

    def upsert(self, vectors, ids) -> None: ...

    def delete(self, ids) -> None: ...

    def search(self, queries, k: int) -> tuple[np.ndarray, np.ndarray]: ...

    def save(self, path) -> None: ...

    @classmethod
    def load(cls, path) -> "Index": ...


def check_vectors(vectors, dim: int, name: str = "vectors") -> np.ndarray:
    """-> float32 C-contiguous ``[n, dim]``, n >= 1.

    Raises:
      TypeError: not a real-valued numeric array.
      ValueError: not 2-D, ``shape[1] != dim``, no rows, or NaN/inf entries (names the first bad row).
    """
    arr = np.asarray(vectors)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name} must be a real numeric array; got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D [n, dim={dim}]; got shape {arr.shape}")
    if arr.shape[1] != dim:
        raise ValueError(f"{name} has dim {arr.shape[1]} but the index dim is {dim}")
    if arr.shape[0] == 0:
        raise ValueError(f"{name} is empty (0 rows); pass at least one vector")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    finite = np.isfinite(arr).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise ValueError(f"{name} has NaN/inf (or float32 overflow) in {bad.size} row(s), first row {bad[0]}; "
                         "clean the embeddings before indexing or searching")
    return arr


def check_ids(ids, n: int) -> np.ndarray:
    """-> int64 ``[n]`` unique ids.

    Raises:
      TypeError: not integers. ValueError: wrong length or duplicates (names one).
    """
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"ids must be 1-D [n]; got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"ids must be integers; got dtype {arr.dtype}")
    if arr.shape[0] != n:
        raise ValueError(f"got {arr.shape[0]} ids for {n} vectors; they must match")
    arr = arr.astype(np.int64)
    uniq, counts = np.unique(arr, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"ids must be unique within one call; id {uniq[counts > 1][0]} appears "
                         f"{counts[counts > 1][0]} times")
    return arr


def check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k={k!r} must be a positive int")
    return int(k)


class VectorStore:
    """Rows ``float32 [n, dim]`` with int64 ids; appends amortized O(1) (capacity doubling).

    ``delete`` moves the last row into each hole, in the order given — the same order ScaNN's
    dynamic index uses (``scann_ops_pybind.ScannSearcher.delete``), so a ScaNN position is a row here.
    """

    def __init__(self, dim: int):
        if not isinstance(dim, (int, np.integer)) or dim < 1:
            raise ValueError(f"dim={dim!r} must be a positive int")
        self.dim = int(dim)
        self._vectors = np.zeros((0, self.dim), np.float32)
        self._ids = np.zeros(0, np.int64)
        self._row: dict[int, int] = {}
        self.n = 0

    @property
    def vectors(self) -> np.ndarray:
        return self._vectors[:self.n]

    @property
    def ids(self) -> np.ndarray:
        return self._ids[:self.n]

    def rows_of(self, ids: np.ndarray) -> list[int | None]:
        return [self._row.get(int(i)) for i in ids]

    def upsert(self, vectors: np.ndarray, ids: np.ndarray) -> list[int | None]:
        """Overwrite rows of known ids, append the rest; returns the old row (or None) per input."""
        rows = self.rows_of(ids)
        new = [j for j, r in enumerate(rows) if r is None]
        old = [j for j, r in enumerate(rows) if r is not None]
        if old:
            self._vectors[[rows[j] for j in old]] = vectors[old]
        if new:
            need = self.n + len(new)
            if need > self._vectors.shape[0]:
                cap = max(need, 2 * self._vectors.shape[0], 16)
                grown = np.zeros((cap, self.dim), np.float32)
                grown[:self.n] = self.vectors
                ids_grown = np.zeros(cap, np.int64)
                ids_grown[:self.n] = self.ids
                self._vectors, self._ids = grown, ids_grown
            self._vectors[self.n:need] = vectors[new]
            self._ids[self.n:need] = ids[new]
            for r, j in enumerate(new, start=self.n):
                self._row[int(ids[j])] = r
            self.n = need
        return rows

    def delete(self, ids: np.ndarray) -> list[int]:
        """Remove ids (all must exist); returns the row each occupied when it was removed."""
        removed = []
        for i in ids:
            r = self._row.pop(int(i))
            last = self.n - 1
            if r != last:
                self._vectors[r] = self._vectors[last]
                self._ids[r] = self._ids[last]
                self._row[int(self._ids[r])] = r
            self.n = last
            removed.append(r)
        return removed

    @classmethod
    def from_arrays(cls, vectors: np.ndarray, ids: np.ndarray) -> "VectorStore":
        store = cls(vectors.shape[1])
        store._vectors, store._ids, store.n = vectors, ids, len(ids)
        store._row = {int(i): r for r, i in enumerate(ids)}
        if len(store._row) != len(ids):
            raise ValueError("stored ids are not unique; the index directory is corrupt")
        return store


class VectorIndex:
    """Shared add/upsert/delete/search validation over a ``VectorStore``.

    Subclasses implement ``_search(queries, k) -> (scores, ids)`` (validated inputs, ``k <= len``) and
    may override ``_changed(rows, removed)`` to follow mutations.
    """

    def __init__(self, dim: int):
        self.store = VectorStore(dim)
        self.dim = self.store.dim

    def __len__(self) -> int:
        return self.store.n

    def add(self, vectors, ids) -> None:
        """Add new vectors ``[n, dim]`` with new int ids ``[n]``.

        Raises:
          ValueError/TypeError: bad vectors or ids (see ``check_vectors``/``check_ids``), or an id that is
            already in the index (use ``upsert`` to overwrite). Nothing is added on error.
        """
        vectors = check_vectors(vectors, self.dim)
        ids = check_ids(ids, vectors.shape[0])
        present = [int(i) for i, r in zip(ids, self.store.rows_of(ids)) if r is not None]
        if present:
            raise ValueError(f"{len(present)} id(s) already in the index, e.g. {present[0]}; use upsert() to "
                             "overwrite existing ids")
        self._changed(vectors, ids, self.store.upsert(vectors, ids))

    def upsert(self, vectors, ids) -> None:
        """Insert new ids, overwrite the vectors of existing ones. Same validation as ``add``."""
        vectors = check_vectors(vectors, self.dim)
        ids = check_ids(ids, vectors.shape[0])
        self._changed(vectors, ids, self.store.upsert(vectors, ids))

    def delete(self, ids) -> None:
        """Delete ids.

        Raises:
          ValueError: an id is not in the index (names it); nothing is deleted then.
        """
        ids = np.atleast_1d(np.asarray(ids))
        ids = check_ids(ids, ids.shape[0])
        missing = [int(i) for i, r in zip(ids, self.store.rows_of(ids)) if r is None]
        if missing:
            raise ValueError(f"{len(missing)} id(s) are not in the index, e.g. {missing[0]}; nothing was deleted")
        self._deleted(self.store.delete(ids))

    def search(self, queries, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k by inner product: ``queries [q, dim]`` -> ``(scores float32 [q, w], ids int64 [q, w])``.

        ``w = min(k, len(self))`` (k larger than the index returns every vector). Missing results of an
        approximate search are id ``-1``, score ``-inf``.

        Raises:
          ValueError: empty index, ``k < 1``, queries not ``[q, dim]`` or with NaN/inf.
        """
        k = check_k(k)
        queries = check_vectors(queries, self.dim, name="queries")
        if self.store.n == 0:
            raise ValueError("the index is empty; add vectors before searching")
        return self._search(queries, min(k, self.store.n))

    def _changed(self, vectors: np.ndarray, ids: np.ndarray, old_rows: list[int | None]) -> None:
        pass

    def _deleted(self, removed_rows: list[int]) -> None:
        pass

    def _search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError
