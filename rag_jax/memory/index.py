"""Growing inner-product index of event representative vectors (one per layer) over ``rag_jax.retrieval``.

EM-LLM ranks a layer's events by the inner product of the chunk's mean query with each event's representative
vector (reference ``VectorTensor.sort_by_similarity``: exact). The vectors live on the host (the reference moves
them to CPU past 50K tokens; host keeps device memory flat) in an ``Index``: ``ScannIndex`` by default, scoring
every event exactly (brute force; ScaNN's quantized search lost the passkey's event at 1M tokens, see
``EMLLMConfig.index``), optionally with its size-based quantized parameters, or ``ExactIndex`` (JAX on the host
CPU device) for validation.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from rag_jax.retrieval.exact import ExactIndex
from rag_jax.retrieval.scann_index import ScannConfig, ScannIndex


def make_index(kind: str, dim: int):
    """A ``rag_jax.retrieval`` index (``EMLLMConfig.index``): ``"scann"`` (``ScannIndex``, brute-force scoring:
    exact at every size), ``"scann_auto"`` (``ScannIndex`` with size-based parameters: quantized above 20K
    events) or ``"exact"`` (``ExactIndex`` on the CPU)."""
    if kind in ("scann", "scann_auto"):
        return ScannIndex(dim, ScannConfig(mode="brute_force" if kind == "scann" else "auto"))
    if kind == "exact":
        return ExactIndex(dim, devices=jax.devices("cpu")[:1])
    raise ValueError(f"index kind={kind!r}; valid: 'scann', 'scann_auto', 'exact'")


class EventIndex:
    """Representative vectors of one layer's events (ids = event numbers, in stream order).

    Args:
      dim: vector size (``num_heads * head_dim``).
      kind: ``"scann"`` or ``"exact"``.
      index_factory: ``(kind, dim) -> Index``; default ``make_index``.
    """

    def __init__(self, dim: int, kind: str = "scann", index_factory: Callable[[str, int], object] | None = None):
        self.dim, self.kind = dim, kind
        self.index = (index_factory or make_index)(kind, dim)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    @property
    def nbytes(self) -> int:
        return self._n * self.dim * 4

    def add(self, vectors: np.ndarray, first_id: int) -> None:
        """Append float32 ``[n, dim]`` vectors with ids ``first_id..first_id+n-1`` (continuing the ids)."""
        vectors = np.asarray(vectors, np.float32)
        if first_id != self._n or vectors.ndim != 2 or vectors.shape[1] != self.dim:
            raise ValueError(f"EventIndex.add expects ids from {self._n} and vectors [n, {self.dim}]; got id "
                             f"{first_id}, shape {vectors.shape}")
        self.index.add(vectors, np.arange(first_id, first_id + len(vectors)))
        self._n += len(vectors)

    def search(self, query: np.ndarray, k: int) -> np.ndarray:
        """Ids (int64 ``[<=k]``) of the events with the largest ``query · vector``, best first."""
        if k <= 0 or self._n == 0:
            return np.zeros(0, np.int64)
        _, ids = self.index.search(np.asarray(query, np.float32).reshape(1, self.dim), k)
        ids = ids[0]
        return ids[ids >= 0]
