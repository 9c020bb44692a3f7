"""ExactIndex vs a float64 NumPy reference; mutations, persistence and bad input (shared by every index)."""
import shutil

import jax
import numpy as np
import pytest

from rag_jax.retrieval.exact import ExactIndex
from rag_jax.retrieval.index import Index

DIM = 48


def _unit(rng, n, d=DIM):
    x = rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _reference(db, ids, queries, k):
    """Naive float64 top-k: (scores, ids) sorted by decreasing inner product."""
    scores = queries.astype(np.float64) @ db.astype(np.float64).T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, 1), ids[order]


@pytest.mark.parametrize("shard_min_rows", [0, 10**9], ids=["sharded-8-devices", "one-device"])
def test_matches_float64_reference(shard_min_rows):
    rng = np.random.default_rng(0)
    db, queries = _unit(rng, 3001), _unit(rng, 19)  # odd sizes: padding of rows and queries
    ids = rng.choice(10**12, size=len(db), replace=False)
    index = ExactIndex(DIM, shard_min_rows=shard_min_rows)
    assert isinstance(index, Index)
    index.add(db, ids)
    scores, got = index.search(queries, 10)
    want_scores, want = _reference(db, ids, queries, 10)
    assert got.dtype == np.int64 and scores.dtype == np.float32 and got.shape == (19, 10)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(scores, want_scores, atol=2e-6)
    if shard_min_rows == 0:
        vectors = index._device_copy[0]
        assert len(vectors.sharding.device_set) == jax.local_device_count() == 8


def test_k_larger_than_index_returns_everything():
    rng = np.random.default_rng(1)
    db, queries = _unit(rng, 7), _unit(rng, 3)
    index = ExactIndex(DIM, shard_min_rows=0)  # 7 rows over 8 devices: most shards are padding
    index.add(db, np.arange(7))
    scores, ids = index.search(queries, 50)
    assert ids.shape == (3, 7) and np.isfinite(scores).all()
    want_scores, want = _reference(db, np.arange(7), queries, 7)
    np.testing.assert_array_equal(ids, want)


def test_upsert_and_delete_visible_in_search():
    rng = np.random.default_rng(2)
    db = _unit(rng, 500)
    index = ExactIndex(DIM)
    index.add(db, np.arange(500))
    q = _unit(rng, 1)
    index.search(q, 5)  # a device copy exists; mutations must invalidate it
    index.upsert(q * 1.0, [1000])           # new id equal to the query: must be top-1
    assert index.search(q, 1)[1][0, 0] == 1000
    index.upsert(q * 2.0, [7])              # overwrite an existing id with a larger vector: now top-1
    scores, ids = index.search(q, 2)
    assert ids[0].tolist() == [7, 1000] and scores[0, 0] == pytest.approx(2.0, abs=1e-5)
    index.delete([7, 1000])
    assert len(index) == 499 and not np.isin([7, 1000], index.search(q, 499)[1]).any()
    expect_db = np.delete(db, 7, axis=0)
    expect_ids = np.delete(np.arange(500), 7)
    np.testing.assert_array_equal(index.search(q, 10)[1], _reference(expect_db, expect_ids, q, 10)[1])


def test_bad_input_is_rejected_and_index_unchanged():
    rng = np.random.default_rng(3)
    index = ExactIndex(DIM)
    with pytest.raises(ValueError, match="empty"):
        index.search(_unit(rng, 1), 3)
    with pytest.raises(ValueError, match="empty"):
        index.add(np.zeros((0, DIM), np.float32), [])
    db = _unit(rng, 20)
    index.add(db, np.arange(20))
    bad = db.copy()
    bad[4, 3] = np.nan
    with pytest.raises(ValueError, match="NaN/inf.*first row 4"):
        index.add(bad, np.arange(100, 120))
    bad[4, 3] = np.inf
    with pytest.raises(ValueError, match="NaN/inf"):
        index.upsert(bad, np.arange(20))
    with pytest.raises(ValueError, match="queries has dim 47 but the index dim is 48"):
        index.search(np.ones((2, 47), np.float32), 3)
    with pytest.raises(ValueError, match="NaN/inf"):
        index.search(np.full((1, DIM), np.inf, np.float32), 3)
    with pytest.raises(ValueError, match="k=0"):
        index.search(db[:1], 0)
    with pytest.raises(ValueError, match="already in the index"):
        index.add(db[:2], [5, 99])
    with pytest.raises(ValueError, match="unique"):
        index.upsert(db[:2], [50, 50])
    with pytest.raises(ValueError, match="got 3 ids for 2 vectors"):
        index.add(db[:2], [50, 51, 52])
    with pytest.raises(TypeError, match="integers"):
        index.add(db[:1], [1.5])
    with pytest.raises(ValueError, match="not in the index.*nothing was deleted"):
        index.delete([3, 12345])
    with pytest.raises(TypeError, match="numeric"):
        index.add([["a"] * DIM], [77])
    assert len(index) == 20
    np.testing.assert_array_equal(index.search(db[:3], 1)[1][:, 0], [0, 1, 2])


def test_save_move_load_identical_and_corruption_detected(tmp_path):
    rng = np.random.default_rng(4)
    db, queries = _unit(rng, 300), _unit(rng, 9)
    index = ExactIndex(DIM)
    index.add(db, np.arange(300) * 3)
    index.delete([0, 30])
    want = index.search(queries, 8)
    index.save(tmp_path / "a")
    shutil.move(tmp_path / "a", tmp_path / "b")
    loaded = ExactIndex.load(tmp_path / "b")
    got = loaded.search(queries, 8)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0], want[0])
    # Saving over an existing index replaces it atomically; no temporary directories are left behind.
    loaded.upsert(db[:1], [999])
    loaded.save(tmp_path / "b")
    assert len(ExactIndex.load(tmp_path / "b")) == 299
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]

    with pytest.raises(FileNotFoundError, match="does not exist"):
        ExactIndex.load(tmp_path / "missing")
    (tmp_path / "notindex").mkdir()
    (tmp_path / "notindex" / "x.txt").write_text("user data")
    with pytest.raises(ValueError, match="no manifest.json"):
        ExactIndex.load(tmp_path / "notindex")
    with pytest.raises(ValueError, match="refusing to overwrite"):
        index.save(tmp_path / "notindex")
    assert (tmp_path / "notindex" / "x.txt").read_text() == "user data"
    vec = tmp_path / "b" / "vectors.npy"
    raw = bytearray(vec.read_bytes())
    raw[-1] ^= 0xFF
    vec.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="vectors.npy fails its CRC-32"):
        ExactIndex.load(tmp_path / "b")
    vec.write_bytes(bytes(raw[:100]))
    with pytest.raises(ValueError, match="vectors.npy has 100 bytes"):
        ExactIndex.load(tmp_path / "b")
    (tmp_path / "b" / "ids.npy").unlink()
    with pytest.raises(ValueError, match="ids.npy listed in manifest.json is missing"):
        ExactIndex.load(tmp_path / "b")
