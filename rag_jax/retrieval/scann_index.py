"""ScaNN index (``scann.scann_ops_pybind``) behind the common ``Index`` interface.

Parameters by corpus size, from ScaNN's ``docs/algorithms.md`` rules of thumb (research note
retrieval_eval.md §1 "Recommended parameters"):
- n < 20K: brute force (exact float32 scoring);
- n < 100K: asymmetric hashing (AH, 2 dims/block, anisotropic threshold 0.2 for unit-norm data with
  dot product) + exact re-scoring ("reorder") of the best candidates;
- n >= 100K: k-means tree with ``num_leaves ≈ sqrt(n)`` (at most n/50: >= 50 points per leaf,
  ScaNN's ``min_partition_size``) + AH + reorder.
Every choice is a ``ScannConfig`` field. The anisotropic threshold is relative to the data's mean norm
(0.2 is ScaNN's value for unit vectors; for non-normalized data the inner products, and so the threshold,
scale with the norms). The re-scoring depth and leaves searched are tuned at build time on a sample of
the indexed vectors, scored leave-one-out (``ScannIndex.tune``), for ``target_recall``, or
``AUTO_TARGET_RECALL`` when the user fixed neither: the size rules were calibrated on random unit
vectors, and on non-normalized, anisotropic data (a Gaussian mixture, 60K x 96) the fixed reorder of 200
reached only recall@10 0.78-0.91.
With an explicit ``target_recall`` the tree's ``num_leaves`` is tuned as well (``sqrt(n)`` and
``2 sqrt(n)`` leaves are both built). The choice is logged (``logging``, INFO) and kept in ``tuning``.

The tree's k-means sample is at least ``TREE_TRAINING_POINTS_PER_LEAF`` (125) points per leaf, as in
ScaNN's example (250K for 2000 leaves): ScaNN's k-means has a minimum partition size of 50 training
points, and with 50 points per leaf (100K for 2000 leaves) the partition fell apart — on 250K clustered
384-d vectors with 500 leaves, recall@10 (reorder 100) searching 1 / 2 / 8 leaves was 0.36 / 0.52 /
0.71 with 25K training points and 0.95 / 0.996 / 0.996 with 62.5K; at 1M vectors and 2000 leaves the
tuning needed 1084 of the 2000 leaves for recall 0.99.

Ids: ScaNN's dynamic index keeps positions dense by moving the last point into a deleted slot (as
its own ``ScannSearcher.delete`` bookkeeping assumes); the ``VectorStore`` does the same, so a ScaNN
position is a store row and ``ids[row]`` is a cheap array lookup (no per-result docid strings).
The store keeps a float32 copy of the vectors (2x memory and disk): it is what a rebuild (the size
changed 2x since the last build, so the size-based parameters are stale), tuning (exact ground
truth) and a portable save need.

Known ScaNN failure modes guarded here (note §1 "Observed behaviour" and issues list): an empty
dataset (tree/AH training fails) -> build is deferred until there are vectors; more leaves than
points -> a ValueError before ScaNN's RuntimeError; absolute paths in saved assets -> saved with
``relative_path=True`` so a moved directory loads; missing results -> id -1 / score -inf.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
import warnings
from pathlib import Path

import numpy as np

from rag_jax.atomic import check_target
from rag_jax.metrics import recall_per_query
from rag_jax.retrieval.exact import ExactIndex, _load_store
from rag_jax.retrieval.index import VectorIndex, check_k, check_vectors
from rag_jax.retrieval.storage import atomic_directory, read_manifest

log = logging.getLogger(__name__)

FORMAT = "rag_jax.scann_index"
AUTO_TARGET_RECALL = 0.97       # recall@num_neighbors the automatic tuning aims at (held-out margin over 0.95)
PRECHECK_QUERIES = 200          # tuning first rejects clear misses on this many of the sample queries
CONFIDENCE_Z = 3.0              # tuning accepts a setting when mean - Z * standard error of the sample recall >= target
MODES = ("auto", "brute_force", "ah", "tree_ah")
BRUTE_FORCE_MAX_SIZE = 20_000   # ScaNN docs: brute force below 20K points
AH_MAX_SIZE = 100_000           # ScaNN docs: AH + reorder below 100K, partitioning above
TREE_TRAINING_POINTS_PER_LEAF = 125  # the tree's k-means sample grows to this many points per leaf (module docstring)


def _scann():
    # Imported lazily: ScaNN is a large C++ extension that exact-index users need not load.
    from scann.scann_ops.py import scann_ops_pybind
    return scann_ops_pybind


@dataclasses.dataclass(frozen=True)
class ScannConfig:
    """ScaNN index parameters; ``None`` = chosen from the corpus size (module docstring).

    Attributes:
      mode: "auto" (by size), "brute_force", "ah" (AH + reorder) or "tree_ah" (tree + AH + reorder).
      num_neighbors: the k that ``target_recall`` refers to (recall@k) and the builder's default k.
      num_leaves: tree leaves (tree_ah); default ``round(sqrt(n))`` capped at ``n / min_points_per_leaf``.
      leaves_to_search: leaves scanned per query; default 5% of ``num_leaves`` (ScaNN's glove example:
        100 of 2000).
      min_points_per_leaf: the smallest allowed average leaf size (ScaNN's ``min_partition_size`` 50).
      dims_per_block: AH dimensions per 4-bit code (ScaNN docs: 2).
      anisotropic_threshold: AH anisotropic quantization threshold relative to the mean vector norm (ScaNN's
        0.2 for unit-norm dot product; ScaNN gets ``anisotropic_threshold * mean norm``); ``float("nan")`` =
        plain AH.
      reorder_num_neighbors: AH candidates re-scored exactly; default: tuned at build time (module
        docstring), starting from ``20 * num_neighbors``.
      training_sample_size: points used to train the AH codebooks and the tree (capped at n; the tree
        takes at least ``TREE_TRAINING_POINTS_PER_LEAF`` per leaf).
      target_recall: if set, ``tune`` runs at every build and picks the fastest (num_leaves,
        leaves_to_search, reorder) reaching this recall@num_neighbors on a sample. None: tuned for
        ``AUTO_TARGET_RECALL`` (leaves_to_search and reorder only) unless ``leaves_to_search`` or
        ``reorder_num_neighbors`` is set.
      num_tuning_queries: sample size for ``tune`` when no queries are given (1000: a standard error of
        the sample recall near 0.001 at recall 0.99; see ``ScannIndex.tune``).
      seed: sampling seed for tuning.
      num_threads: ScaNN training/search threads; 0 = all cores.
    """

    mode: str = "auto"
    num_neighbors: int = 10
    num_leaves: int | None = None
    leaves_to_search: int | None = None
    min_points_per_leaf: int = 50
    dims_per_block: int = 2
    anisotropic_threshold: float = 0.2
    reorder_num_neighbors: int | None = None
    training_sample_size: int = 100_000
    target_recall: float | None = None
    num_tuning_queries: int = 1000
    seed: int = 0
    num_threads: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"ScannConfig.mode={self.mode!r}; valid: {MODES}")
        for name in ("num_neighbors", "min_points_per_leaf", "dims_per_block", "training_sample_size",
                     "num_tuning_queries"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ScannConfig.{name}={value!r} must be a positive int")
        for name in ("num_leaves", "leaves_to_search", "reorder_num_neighbors"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"ScannConfig.{name}={value!r} must be None (auto) or a positive int")
        if not (isinstance(self.anisotropic_threshold, (int, float)) and not isinstance(self.anisotropic_threshold, bool)
                and (math.isnan(self.anisotropic_threshold) or 0 <= self.anisotropic_threshold < math.inf)):
            raise ValueError(f"ScannConfig.anisotropic_threshold={self.anisotropic_threshold!r} must be a finite "
                             "number >= 0 (relative to the mean norm) or nan (plain AH)")
        if self.target_recall is not None and not 0.0 < self.target_recall <= 1.0:
            raise ValueError(f"ScannConfig.target_recall={self.target_recall!r} must be in (0, 1]")
        if not isinstance(self.num_threads, int) or self.num_threads < 0:
            raise ValueError(f"ScannConfig.num_threads={self.num_threads!r} must be an int >= 0 (0 = all cores)")

    def auto_tuned(self) -> bool:
        """True when ``build`` tunes for ``AUTO_TARGET_RECALL`` (no target and no fixed query parameters)."""
        return self.target_recall is None and self.leaves_to_search is None and self.reorder_num_neighbors is None

    def resolve(self, n: int) -> dict:
        """Concrete parameters for ``n`` points: mode, num_leaves, leaves_to_search, reorder.

        Raises:
          ValueError: ``num_leaves`` too large for ``n`` (fewer than ``min_points_per_leaf`` points per
            leaf; ScaNN would fail or build near-empty leaves), or ``leaves_to_search > num_leaves``.
        """
        mode = self.mode
        if mode == "auto":
            mode = "brute_force" if n < BRUTE_FORCE_MAX_SIZE else "ah" if n < AH_MAX_SIZE else "tree_ah"
        out = {"mode": mode, "num_leaves": None, "leaves_to_search": None, "reorder": None}
        if mode in ("ah", "tree_ah"):
            out["reorder"] = self.reorder_num_neighbors or 20 * self.num_neighbors
        if mode == "tree_ah":
            max_leaves = n // self.min_points_per_leaf
            num_leaves = self.num_leaves or min(round(math.sqrt(n)), max_leaves)
            if num_leaves > max_leaves or num_leaves < 1:
                raise ValueError(
                    f"num_leaves={num_leaves} needs at least {max(num_leaves, 1) * self.min_points_per_leaf} points "
                    f"(min_points_per_leaf={self.min_points_per_leaf}) but the index holds {n}; use num_leaves <= "
                    f"{max(max_leaves, 1)} with enough points, mode='ah' or 'brute_force', or mode='auto' "
                    "(tree only from 100K points)")
            leaves = self.leaves_to_search or max(1, math.ceil(0.05 * num_leaves))
            if leaves > num_leaves:
                raise ValueError(f"leaves_to_search={leaves} exceeds num_leaves={num_leaves}")
            out.update(num_leaves=num_leaves, leaves_to_search=leaves)
        return out


class ScannIndex(VectorIndex):
    """ScaNN top-k inner-product index (dot product, larger = closer). See module docstring.

    The searcher is (re)built lazily at the first search after the size changed 2x since the last
    build (or on ``build()``); smaller changes go into ScaNN incrementally (upsert/delete).
    Concurrent searches are fine; mutations must be serialised by the caller (ScaNN documents no
    thread safety for writers, note §1).
    """

    def __init__(self, dim: int, config: ScannConfig | None = None):
        super().__init__(dim)
        self.config = config or ScannConfig()
        self._searcher = None
        self._built_size = 0
        self.params: dict = {}     # resolved parameters of the current searcher
        self.tuning: dict | None = None  # result of the last tune()

    # -- build / incremental sync -------------------------------------------------------------
    def build(self) -> None:
        """Train and build the ScaNN searcher over the current vectors, then ``tune`` if target_recall is set.

        Raises:
          ValueError: the index is empty, or parameters invalid for its size (see ``ScannConfig.resolve``).
        """
        self._build_searcher()
        cfg = self.config
        if cfg.target_recall is not None:
            self.tune(cfg.target_recall, tune_leaves=cfg.num_leaves is None)
        elif cfg.auto_tuned() and self.params["mode"] != "brute_force" and len(self) > cfg.num_neighbors:
            self.tune(AUTO_TARGET_RECALL, quiet=True)

    def _build_searcher(self, num_leaves: int | None = None) -> None:
        n = len(self)
        if n == 0:
            raise ValueError("cannot build a ScaNN index over 0 vectors (empty corpus); add vectors first")
        cfg = self.config
        params = (cfg if num_leaves is None else dataclasses.replace(cfg, num_leaves=num_leaves)).resolve(n)
        sample_rows = np.random.default_rng(cfg.seed).choice(n, size=min(n, 10_000), replace=False)
        mean_norm = float(np.mean(np.linalg.norm(self.store.vectors[sample_rows], axis=1)))
        params["anisotropic_threshold"] = cfg.anisotropic_threshold * mean_norm
        builder = _scann().builder(self.store.vectors, cfg.num_neighbors, "dot_product")
        if cfg.num_threads:
            builder = builder.set_n_training_threads(cfg.num_threads)
        sample = min(cfg.training_sample_size, n)
        if params["mode"] == "tree_ah":
            tree_sample = min(n, max(sample, TREE_TRAINING_POINTS_PER_LEAF * params["num_leaves"]))
            builder = builder.tree(params["num_leaves"], params["leaves_to_search"], training_sample_size=tree_sample)
        if params["mode"] == "brute_force":
            builder = builder.score_brute_force()
        else:
            builder = builder.score_ah(cfg.dims_per_block,
                                       anisotropic_quantization_threshold=params["anisotropic_threshold"],
                                       training_sample_size=sample).reorder(params["reorder"])
        searcher = builder.build()
        if cfg.num_threads:
            searcher.set_num_threads(cfg.num_threads)
        self._searcher, self._built_size, self.params, self.tuning = searcher, n, params, None

    def _stale(self) -> bool:
        n = len(self)
        return self._searcher is None or n > 2 * self._built_size or 2 * n < self._built_size

    def _changed(self, vectors, ids, old_rows) -> None:
        if self._stale():
            self._searcher = None
        else:
            self._searcher.searcher.upsert(old_rows, vectors, 1)

    def _deleted(self, removed_rows) -> None:
        if self._stale() or len(self) == 0:
            self._searcher = None
        else:
            self._searcher.searcher.delete(removed_rows)

    # -- search --------------------------------------------------------------------------------
    def _raw_search(self, queries: np.ndarray, k: int, leaves, reorder):
        # search_batched_parallel: ScaNN's own thread pool over query batches (GIL released).
        pre = max(reorder, k) if reorder is not None else None
        return self._searcher.search_batched_parallel(queries, final_num_neighbors=k, pre_reorder_num_neighbors=pre,
                                                      leaves_to_search=leaves)

    def _search(self, queries, k):
        if self._stale():
            self.build()
        rows, dist = self._raw_search(queries, k, self.params["leaves_to_search"], self.params["reorder"])
        return self._to_ids(rows, dist, k)

    def _to_ids(self, rows, dist, k):
        rows = np.asarray(rows, np.int64)
        scores = np.asarray(dist, np.float32)
        missing = ~np.isfinite(scores) | (rows >= len(self))
        ids = self.store.ids[np.where(missing, 0, rows)]
        ids[missing] = -1
        scores = np.where(missing, -np.inf, scores).astype(np.float32)
        if scores.shape[1] < k:  # ScaNN returns fewer columns when it scanned fewer points
            pad = k - scores.shape[1]
            scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=-np.inf)
            ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
        return scores, ids

    # -- tuning ---------------------------------------------------------------------------------
    def tune(self, target_recall: float, queries=None, *, k: int | None = None, repeats: int = 5,
             tune_leaves: bool = False, quiet: bool = False) -> dict:
        """Pick the fastest ``(num_leaves, leaves_to_search, reorder)`` reaching ``target_recall`` recall@k vs exact.

        A setting reaches the target when its sample recall minus ``CONFIDENCE_Z`` (3) standard errors
        (over the per-query recalls) is >= ``target_recall``: picking the fastest of ~20 settings that
        barely pass on one sample otherwise favours those whose sample was lucky, and on clustered data
        a few queries that miss a split cluster make the per-query recall heavy-tailed. Measured on 100K
        clustered 384-d vectors, 0.99 target: 200 sample queries and the plain mean gave 0.984 on fresh
        queries; 1000 queries and 2 standard errors 0.9886 (sample 0.9933; the same rows scored 0.992
        at settings where 5000 fresh queries scored 0.990).

        Grid: reorder counts ``k·1.25^i`` (up to ~100·k and n) and, for tree_ah, leaves counts on a ~1.15x
        geometric grid up to num_leaves; for each reorder count a binary search finds the fewest leaves
        that reach the target (recall grows with leaves; the search stops at the first reorder count that
        needs a single leaf, or once 3 more reorder steps saved no leaf). A setting whose recall on
        ``PRECHECK_QUERIES`` spread sample queries is below the target by ``CONFIDENCE_Z`` standard errors
        is rejected without the full sample (each check of an unreachable reorder count scans all
        leaves). The candidates are timed (median of ``repeats`` runs over the sample) and the fastest is
        kept for later searches. With ``tune_leaves`` (tree_ah only) the tree is also rebuilt with
        ``2·num_leaves`` leaves (when the size allows) and the faster of the two trees is kept.

        Args:
          target_recall: in (0, 1].
          queries: ``[q, dim]`` held-out queries; default ``num_tuning_queries`` vectors sampled from the
            index, scored leave-one-out: each is searched for k+1 neighbours and its own id is removed
            from both the ScaNN and the exact result lists, so the trivial self-match does not inflate
            recall (measured: leave-one-out and fresh-query recall agree within the sampling error).
          k: recall@k; default ``config.num_neighbors``.
          tune_leaves: also try a tree with twice the leaves (costs one more build).
          quiet: no warning when the target is missed (the automatic build-time tuning).

        Returns: ``{"num_leaves", "leaves_to_search", "reorder", "recall", "recall_lower", "reached",
        "target_recall", "candidates"}`` (``recall``: sample mean; ``recall_lower``: minus Z standard errors);
        ``reached`` is False (with a warning) when even the most expensive setting misses the target —
        the most accurate setting is kept then. Brute-force indexes are exact: nothing to tune.

        Raises:
          ValueError: target_recall outside (0, 1], bad queries or k, empty index.
        """
        if isinstance(target_recall, bool) or not isinstance(target_recall, (int, float)) \
                or not 0.0 < target_recall <= 1.0:
            raise ValueError(f"target_recall={target_recall!r} must be in (0, 1]")
        if len(self) == 0:
            raise ValueError("cannot tune an empty index; add vectors first")
        if self._stale():
            self._build_searcher()
        if self.params["mode"] == "brute_force":
            self.tuning = {"num_leaves": None, "leaves_to_search": None, "reorder": None, "recall": 1.0,
                           "recall_lower": 1.0, "reached": True, "target_recall": target_recall, "candidates": []}
            return self.tuning
        n = len(self)
        k = check_k(k if k is not None else self.config.num_neighbors)
        if queries is None:
            rng = np.random.default_rng(self.config.seed)
            rows = np.sort(rng.choice(n, size=min(self.config.num_tuning_queries, n), replace=False))
            queries, self_ids = self.store.vectors[rows].copy(), self.store.ids[rows].copy()
            k = min(k, n - 1)
            if k < 1:
                raise ValueError("leave-one-out tuning needs at least 2 vectors; pass queries=")
        else:
            queries, self_ids = check_vectors(queries, self.dim, name="queries"), None
            k = min(k, n)
        fetch = k + (self_ids is not None)
        truth = _drop_self(self._exact_ids(queries, fetch), self_ids, k)
        trees = [self.params["num_leaves"]]
        if tune_leaves and self.params["mode"] == "tree_ah" and 2 * trees[0] <= n // self.config.min_points_per_leaf:
            trees.append(2 * trees[0])
        results = []
        for num_leaves in trees:
            if num_leaves != self.params["num_leaves"]:
                self._build_searcher(num_leaves)
            best, candidates, reached = self._tune_queries(queries, self_ids, truth, k, fetch, target_recall, repeats)
            results.append((not reached, best["seconds"], num_leaves, best, candidates, reached,
                            (self._searcher, self.params)))
        _, _, num_leaves, best, candidates, reached, (searcher, params) = min(results, key=lambda r: r[:2])
        if not reached and not quiet:
            warnings.warn(f"ScaNN tuning: target_recall={target_recall} not reached; the most accurate setting "
                          f"{best} is used. Use more leaves (num_leaves) or mode='brute_force'.", stacklevel=2)
        self._searcher = searcher
        self.params = dict(params, leaves_to_search=best["leaves_to_search"], reorder=best["reorder"])
        self.tuning = {"num_leaves": num_leaves, "leaves_to_search": best["leaves_to_search"],
                       "reorder": best["reorder"], "recall": best["recall"],
                       "recall_lower": best["recall_lower"], "reached": reached,
                       "target_recall": target_recall, "candidates": candidates}
        log.info("ScaNN tuned for recall@%d >= %s on %d sample queries: num_leaves=%s leaves_to_search=%s "
                 "reorder=%s (sample recall %.4f, lower bound %.4f%s)", k, target_recall, len(queries), num_leaves,
                 best["leaves_to_search"], best["reorder"], best["recall"], best["recall_lower"],
                 "" if reached else ", target missed")
        return self.tuning

    def _exact_ids(self, queries: np.ndarray, k: int) -> np.ndarray:
        """Exact top-k ids ``[q, k]`` (``ExactIndex``), 100 queries at a time: 1000 at once against 1M vectors
        would hold a 4 GB score matrix. Its device copy of the vectors is freed on return, before any rebuild."""
        exact = ExactIndex(self.dim)
        exact.store = self.store
        return np.concatenate([exact.search(queries[i:i + 100], k)[1] for i in range(0, len(queries), 100)])

    def _tune_queries(self, queries, self_ids, truth, k, fetch, target_recall, repeats):
        """(fastest candidate, all candidates, reached) for the current searcher: see ``tune``."""
        n = len(self)

        def sample_recall(leaves, reorder, part=slice(None)) -> tuple[float, float]:
            """(mean recall@k, its standard error) over the sample queries ``part``."""
            rows, dist = self._raw_search(queries[part], fetch, leaves, reorder)
            found = _drop_self(self._to_ids(rows, dist, fetch)[1], None if self_ids is None else self_ids[part], k)
            per_query = np.array(recall_per_query(found, truth[part], k))
            sem = per_query.std(ddof=1) / math.sqrt(len(per_query)) if len(per_query) > 1 else 0.0
            return float(per_query.mean()), float(sem)

        def recall(leaves, reorder) -> dict:
            mean, sem = sample_recall(leaves, reorder)
            return {"recall": mean, "recall_lower": mean - CONFIDENCE_Z * sem}

        def passes(leaves, reorder) -> bool:
            if len(queries) >= 2 * PRECHECK_QUERIES:  # a clear miss on a spread subsample costs a fraction
                mean, sem = sample_recall(leaves, reorder, slice(None, None, len(queries) // PRECHECK_QUERIES))
                if mean + CONFIDENCE_Z * sem < target_recall:
                    return False
            return recall(leaves, reorder)["recall_lower"] >= target_recall

        reorders = sorted({min(round(fetch * 1.25 ** i), n) for i in range(21)})  # up to ~100·k
        if self.params["mode"] == "tree_ah":
            num_leaves = self.params["num_leaves"]
            leaves_grid = sorted({max(1, min(num_leaves, round(1.15 ** i))) for i in range(200)})
        else:
            leaves_grid = [None]
        candidates = []
        for reorder in reorders:
            lo, hi = 0, len(leaves_grid) - 1
            if candidates:  # more reorder never needs more leaves: search below the last answer
                hi = leaves_grid.index(candidates[-1]["leaves_to_search"])
            if not passes(leaves_grid[hi], reorder):
                continue
            while lo < hi:  # fewest leaves reaching the target
                mid = (lo + hi) // 2
                if passes(leaves_grid[mid], reorder):
                    hi = mid
                else:
                    lo = mid + 1
            candidates.append({"leaves_to_search": leaves_grid[lo], "reorder": reorder,
                               **recall(leaves_grid[lo], reorder)})
            if lo == 0:  # one leaf (or no tree) suffices: more reorder only costs time
                break
            if len(candidates) >= 4 and candidates[-4]["leaves_to_search"] == leaves_grid[lo]:
                break  # leaves stopped falling over 3 reorder steps: more reorder only costs time
        reached = bool(candidates)
        if not reached:
            best = {"leaves_to_search": leaves_grid[-1], "reorder": reorders[-1]}
            best.update(recall(best["leaves_to_search"], best["reorder"]))
            candidates = [best]
        for c in candidates:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                self._raw_search(queries, fetch, c["leaves_to_search"], c["reorder"])
                times.append(time.perf_counter() - start)
            c["seconds"] = float(np.median(times))
        return min(candidates, key=lambda c: c["seconds"]), candidates, reached

    # -- persistence ------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> None:
        """Write vectors, ids, the ScaNN searcher (``relative_path=True``) and a manifest, atomically.

        Builds the searcher first if needed, so ``load`` never retrains. ``path`` may hold an earlier
        ScaNN index (replaced); anything else is refused (``storage.atomic_directory``).

        Raises:
          ValueError: the index is empty; ``TargetExistsError`` (a ValueError) for a refused ``path``.
        """
        check_target(path, FORMAT, overwrite=overwrite)
        if self._stale():
            self.build()
        meta = {"dim": self.dim, "size": len(self), "config": dataclasses.asdict(self.config),
                "params": self.params, "built_size": self._built_size, "tuning": self.tuning}
        with atomic_directory(path, FORMAT, meta, overwrite=overwrite) as tmp:
            np.save(tmp / "vectors.npy", self.store.vectors)
            np.save(tmp / "ids.npy", self.store.ids)
            (tmp / "scann").mkdir()
            self._searcher.serialize(str(tmp / "scann"), relative_path=True)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ScannIndex":
        """Load a saved index (no retraining). Raises FileNotFoundError / ValueError (corrupt or other format)."""
        path = Path(path)
        meta = read_manifest(path, FORMAT)
        index = cls(meta["dim"], ScannConfig(**meta["config"]))
        index.store = _load_store(path, meta)
        if not (path / "scann" / "scann_assets.pbtxt").is_file():
            raise ValueError(f"corrupt index directory {path}: scann/scann_assets.pbtxt is missing")
        index._searcher = _scann().load_searcher(str(path / "scann"))
        if index._searcher.size() != len(index):
            raise ValueError(f"corrupt index directory {path}: ScaNN holds {index._searcher.size()} points, "
                             f"ids.npy {len(index)}")
        index._built_size, index.params, index.tuning = meta["built_size"], meta["params"], meta["tuning"]
        return index


def _drop_self(ids: np.ndarray, self_ids: np.ndarray | None, k: int) -> np.ndarray:
    """Per row, remove the query's own id (leave-one-out) and keep the first k."""
    if self_ids is None:
        return ids[:, :k]
    out = np.empty((ids.shape[0], k), np.int64)
    for r, (row, own) in enumerate(zip(ids, self_ids)):
        out[r] = row[row != own][:k] if (row == own).any() else row[:k]
    return out
