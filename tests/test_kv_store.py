"""KVStore: never stale (tokens / model / dtype / namespace change => miss), byte bound, LRU, host tier."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax.inference.kv_store import KVStore, cache_key, model_fingerprint
from rag_jax.model import KVSegment

LAYERS, HEADS, HEAD_DIM = 2, 2, 8


def _segment(n: int, seed: int, dtype=jnp.float32) -> KVSegment:
    rng = np.random.default_rng(seed)
    shape = (LAYERS, 1, n, HEADS, HEAD_DIM)
    return KVSegment(k=jnp.asarray(rng.standard_normal(shape), dtype), v=jnp.asarray(rng.standard_normal(shape), dtype),
                     positions=jnp.arange(n, dtype=jnp.int32)[None], segment_ids=jnp.ones((1, n), jnp.int32))


def _ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 1000, n).tolist()


def test_hit_returns_the_stored_segment_and_misses_on_any_key_change():
    store = KVStore(max_bytes=10**7)
    ids = _ids(12, 0)
    seg = _segment(12, 0)
    assert store.put(ids, "model-a", jnp.float32, seg)
    hit = store.get(ids, "model-a", "float32")
    np.testing.assert_array_equal(np.asarray(hit.k), np.asarray(seg.k))
    np.testing.assert_array_equal(np.asarray(hit.v), np.asarray(seg.v))
    changed = list(ids)
    changed[5] += 1
    assert store.get(changed, "model-a", jnp.float32) is None            # one token differs
    assert store.get(ids[:-1], "model-a", jnp.float32) is None           # prefix of the tokens
    assert store.get(ids + [7], "model-a", jnp.float32) is None          # longer
    assert store.get(ids, "model-b", jnp.float32) is None                # another model
    assert store.get(ids, "model-a", jnp.bfloat16) is None               # another dtype
    assert store.get(ids, "model-a", jnp.float32, namespace="grit") is None
    assert store.stats["hits"] == 1 and store.stats["misses"] == 6


def test_hash_collision_is_not_returned():
    """Even if two token lists shared a key, the stored ids are compared: no stale hit."""
    store = KVStore(max_bytes=10**7)
    ids, other = _ids(6, 1), _ids(6, 2)
    store.put(ids, "m", jnp.float32, _segment(6, 1))
    key = cache_key(ids, "m", jnp.float32)
    store._device[cache_key(other, "m", jnp.float32)] = store._device[key]  # forge a colliding key
    assert store.get(other, "m", jnp.float32) is None


def test_byte_bound_and_lru_order():
    seg_bytes = _segment(10, 0).nbytes
    store = KVStore(max_bytes=3 * seg_bytes + seg_bytes // 2)
    for i in range(3):
        store.put(_ids(10, i), "m", jnp.float32, _segment(10, i))
    assert store.get(_ids(10, 0), "m", jnp.float32) is not None          # 0 becomes most recent
    store.put(_ids(10, 3), "m", jnp.float32, _segment(10, 3))            # evicts LRU = entry 1
    assert store.nbytes <= store.max_bytes and len(store) == 3
    assert store.get(_ids(10, 1), "m", jnp.float32) is None
    for i in (0, 2, 3):
        assert store.get(_ids(10, i), "m", jnp.float32) is not None
    assert store.stats["evictions"] == 1
    for i in range(4, 40):                                               # many inserts: bound holds
        store.put(_ids(10, i), "m", jnp.float32, _segment(10, i))
        assert store.nbytes <= store.max_bytes
    too_big = _segment(100, 9)
    assert not store.put(_ids(100, 9), "m", jnp.float32, too_big)
    assert store.get(_ids(100, 9), "m", jnp.float32) is None


def test_host_tier_offloads_and_restores_exact_values():
    seg_bytes = _segment(8, 0, jnp.bfloat16).nbytes
    store = KVStore(max_bytes=seg_bytes, host_max_bytes=2 * seg_bytes)
    segs = {i: _segment(8, i, jnp.bfloat16) for i in range(4)}
    for i, seg in segs.items():
        store.put(_ids(8, i), "m", jnp.bfloat16, seg)
    assert store.nbytes <= seg_bytes and store.host_nbytes <= 2 * seg_bytes
    host_entry = next(iter(store._host.values()))
    assert isinstance(host_entry.segment.k, np.ndarray)                  # really on the host
    assert store.get(_ids(8, 0), "m", jnp.bfloat16) is None              # fell off both tiers
    restored = store.get(_ids(8, 1), "m", jnp.bfloat16)                  # host hit -> back on device
    assert isinstance(restored.k, jax.Array)
    np.testing.assert_array_equal(np.asarray(restored.k, np.float32), np.asarray(segs[1].k, np.float32))
    assert store.stats["host_hits"] == 1
    # An entry larger than the device tier lives on the host and does not flush the device tier.
    big = _segment(12, 7, jnp.bfloat16)
    device_keys = list(store._device)
    assert store.put(_ids(12, 7), "m", jnp.bfloat16, big) and list(store._device) == device_keys
    np.testing.assert_array_equal(np.asarray(store.get(_ids(12, 7), "m", jnp.bfloat16).v, np.float32),
                                  np.asarray(big.v, np.float32))
    assert list(store._device) == device_keys and store.host_nbytes <= store.host_max_bytes


def test_put_validates_dtype_and_length():
    store = KVStore(max_bytes=10**6)
    with pytest.raises(ValueError, match="dtype"):
        store.put(_ids(4, 0), "m", jnp.bfloat16, _segment(4, 0, jnp.float32))
    with pytest.raises(ValueError, match="length"):
        store.put(_ids(5, 0), "m", jnp.float32, _segment(4, 0))
    with pytest.raises(ValueError, match="max_bytes"):
        KVStore(max_bytes=-1)


def test_model_fingerprint_changes_with_weights_and_config():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((4, 4)), jnp.float32), "b": jnp.zeros(4)}
    fp = model_fingerprint(params, config="cfg1")
    assert fp == model_fingerprint(dict(params), config="cfg1")
    bumped = dict(params, w=params["w"].at[1, 2].add(1e-3))
    assert model_fingerprint(bumped, config="cfg1") != fp
    assert model_fingerprint(params, config="cfg2") != fp
    assert model_fingerprint(dict(params, w=params["w"].astype(jnp.bfloat16)), config="cfg1") != fp
