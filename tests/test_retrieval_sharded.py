"""Sharded retrieval: local top-k per shard + global merge == one index over the whole corpus.

Run as a script, this file is the worker of the 2-process test (one JAX job on loopback).
"""
import sys
from pathlib import Path

import numpy as np
import pytest

N, DIM, NUM_QUERIES, K = 2001, 24, 16, 12


def corpus():
    """The same seeded corpus on every process; ids are shuffled so row order != id order."""
    rng = np.random.default_rng(0)
    db = rng.standard_normal((N, DIM)).astype(np.float32)
    queries = rng.standard_normal((NUM_QUERIES, DIM)).astype(np.float32)
    ids = rng.choice(10**11, size=N, replace=False).astype(np.int64)  # > 2^32: exercises int64 transport
    return db, ids, queries


def worker(out_dir: str) -> None:
    from rag_jax import distributed
    distributed.initialize()
    import jax

    from rag_jax.retrieval.exact import ExactIndex
    from rag_jax.retrieval.scann_index import ScannIndex
    from rag_jax.retrieval.sharded import ShardedIndex, shard_slice

    db, ids, queries = corpus()
    rows = shard_slice(N)
    exact = ShardedIndex(ExactIndex(DIM, shard_min_rows=0))  # also row-sharded over this process's 2 devices
    exact.add(db[rows], ids[rows])
    scann = ShardedIndex(ScannIndex(DIM))  # brute force at this size
    scann.add(db[rows], ids[rows])
    results = {"exact": exact.search(queries, K), "scann": scann.search(queries, K)}
    exact.save(Path(out_dir) / "sharded")
    reloaded = ShardedIndex.load(Path(out_dir) / "sharded", ExactIndex)
    results["reloaded"] = reloaded.search(queries, K)
    bad = None
    try:  # mismatched queries across processes must be refused, not merged
        exact.search(queries + jax.process_index(), K)
    except ValueError as e:
        bad = str(e)
    np.savez(Path(out_dir) / f"p{jax.process_index()}.npz", devices=jax.local_device_count(),
             processes=jax.process_count(), rows=[rows.start, rows.stop], refused=bad or "",
             **{f"{name}_{part}": arr for name, (s, i) in results.items() for part, arr in (("scores", s), ("ids", i))})


def test_merge_of_shards_equals_single_index():
    from rag_jax.retrieval.exact import ExactIndex
    from rag_jax.retrieval.sharded import ShardedIndex, merge_top_k, shard_slice

    db, ids, queries = corpus()
    single = ExactIndex(DIM)
    single.add(db, ids)
    want = single.search(queries, K)
    parts = []
    for p in range(3):
        rows = shard_slice(N, p, 3)
        shard = ExactIndex(DIM)
        shard.add(db[rows], ids[rows])
        parts.append(shard.search(queries, K))
    assert [shard_slice(N, p, 3) for p in range(3)] == [slice(0, 667), slice(667, 1334), slice(1334, 2001)]
    got = merge_top_k([s for s, _ in parts], [i for _, i in parts], K)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0], want[0])
    # Single process: ShardedIndex over the whole corpus is the plain index (allgather of one process).
    whole = ShardedIndex(single)
    np.testing.assert_array_equal(whole.search(queries, K)[1], want[1])


def test_merge_ties_padding_and_errors():
    from rag_jax.retrieval.sharded import merge_top_k, shard_slice

    scores = [np.array([[0.9, 0.5, -np.inf]], np.float32), np.array([[0.9, 0.7]], np.float32)]
    ids = [np.array([[8, 3, -1]]), np.array([[2, 4]])]
    s, i = merge_top_k(scores, ids, 3)
    assert i.tolist() == [[2, 8, 4]] and s[0].tolist() == pytest.approx([0.9, 0.9, 0.7])
    s, i = merge_top_k(scores, ids, 10)  # only 4 real candidates exist
    assert i.tolist() == [[2, 8, 4, 3]]
    # Rows with fewer real candidates than others are padded with (-inf, -1).
    s, i = merge_top_k([np.array([[1.0, 0.5], [2.0, -np.inf]], np.float32)], [np.array([[1, 2], [3, -1]])], 2)
    assert i.tolist() == [[1, 2], [3, -1]] and s[1, 1] == -np.inf
    with pytest.raises(ValueError, match="one ids array per scores"):
        merge_top_k(scores, ids[:1], 3)
    with pytest.raises(ValueError, match="k=0"):
        merge_top_k(scores, ids, 0)
    with pytest.raises(ValueError, match="process_index"):
        shard_slice(10, 2, 2)


def test_two_processes_sharded_index_equals_single_index(tmp_path):
    from rag_jax import distributed
    from rag_jax.retrieval.exact import ExactIndex
    from rag_jax.retrieval.scann_index import ScannIndex

    distributed.launch_local([sys.executable, str(Path(__file__).resolve()), str(tmp_path)], num_processes=2,
                             devices_per_process=2, timeout_s=240)
    db, ids, queries = corpus()
    want = {}
    for name, index in (("exact", ExactIndex(DIM)), ("scann", ScannIndex(DIM))):
        index.add(db, ids)
        want[name] = index.search(queries, K)
    want["reloaded"] = want["exact"]
    per_process = [np.load(tmp_path / f"p{p}.npz") for p in range(2)]
    assert [r["rows"].tolist() for r in per_process] == [[0, 1001], [1001, 2001]]
    for r in per_process:
        assert int(r["processes"]) == 2 and int(r["devices"]) == 2
        assert "different queries" in str(r["refused"])
        for name, (scores, found) in want.items():
            np.testing.assert_array_equal(r[f"{name}_ids"], found, err_msg=name)
            np.testing.assert_array_equal(r[f"{name}_scores"], scores, err_msg=name)
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == ["shard-00000-of-00002",
                                                                        "shard-00001-of-00002"]


if __name__ == "__main__":
    worker(sys.argv[1])
