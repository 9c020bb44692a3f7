"""EM-LLM event memory: representative vectors, token-budget retrieval with closest fit, contiguity buffer, the
event index and the bounded device cache (note em_llm.md §4)."""
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax.memory import (ContiguityBuffer, DeviceEventCache, EMLLMConfig, EventIndex, EventStore,
                            merge_temporal, representative_vectors, retrieval_budget, select_by_similarity)


def test_representative_vectors_equal_float64_reference():
    rng = np.random.default_rng(0)
    layers, max_len, kv_heads, heads, d, topk = 2, 12, 2, 4, 8, 4
    keys = rng.normal(size=(layers, max_len, kv_heads, d)).astype(np.float32)
    scores = rng.random((layers, heads, max_len)).astype(np.float32)
    for size in (7, 2, 12):
        got = np.asarray(representative_vectors(jnp.asarray(keys), jnp.asarray(scores), size, topk))
        want = np.zeros((layers, heads, d))
        for layer in range(layers):
            for h in range(heads):
                top = np.argsort(-scores[layer, h, :size])[:min(topk, size)]
                want[layer, h] = keys[layer, top, h // (heads // kv_heads)].astype(np.float64).mean(0)
        np.testing.assert_allclose(got, want.reshape(layers, heads * d), rtol=1e-6, atol=1e-6)
    # Query heads of one KV group pick different tokens: their vectors differ (not reducible to KV heads).
    assert not np.allclose(got[0, :d], got[0, d:2 * d])


def test_budget_matches_reference_formula():
    cfg = EMLLMConfig(n_init=128, n_local=4096, n_mem=2048, chunk_size=512, min_block_size=8, max_block_size=128)
    # Steady state: 100 buffered tokens outside the window, init counted once the stream exceeds n_local.
    assert retrieval_budget(cfg, 4096 + 100, 512, 128, 10_000) == (128 + 512 + 2048 - 612 - 128, 0)
    assert retrieval_budget(cfg, 0, 512, 0, 0) == (128 + 512 + 2048, 0)
    ctg = cfg.replace(contiguity=True)
    cap = 128 + 512 + 2048 - 612 - 128
    assert retrieval_budget(ctg, 4196, 512, 128, 10_000) == (cap - int(0.3 * cap + 1), int(0.3 * cap + 1))


def test_similarity_selection_closest_fit():
    sizes = [10, 30, 20, 40, 8]
    # 30 + 40 = 70 < 75; adding 20 gives 90: |75-70| = 5 <= |90-75| = 15 -> drop the crossing event.
    assert select_by_similarity([1, 3, 2, 0, 4], sizes, 75) == [1, 3]
    # Cap 85: |85-70| = 15 > |90-85| = 5 -> keep it.
    assert select_by_similarity([1, 3, 2, 0, 4], sizes, 85) == [1, 3, 2]
    # Everything fits -> all events, in order.
    assert select_by_similarity([4, 0], sizes, 108) == [0, 1, 2, 3, 4]
    assert merge_temporal([3, 1], [2, 1]) == [1, 2, 3]


def test_contiguity_buffer_neighbours_and_refill():
    sizes = [10] * 10
    buf = ContiguityBuffer()
    # Neighbours of 5 then 2: 6, 4, 3, 1 (b+1 first); cap 25 -> 6, 4, then 3 crosses (30 vs 25: tie -> drop).
    assert buf.update([5, 2], sizes, 25) == [4, 6]
    # Buffer not full: appends new neighbours while the total stays under the cap.
    buf2 = ContiguityBuffer()
    buf2.update([5], sizes, 45)            # [4, 6]
    # Neighbours of 8 (9, 7: 20 tokens) fit next to the buffer's 20 (40 < 45): appended, in temporal order.
    assert buf2.update([8], sizes, 45) == [4, 6, 7, 9]
    # Nothing similar -> unchanged.
    assert buf2.update([], sizes, 45) == [4, 6, 7, 9]


def test_contiguity_overflow_keeps_new_neighbours_first():
    sizes = [10] * 20
    buf = ContiguityBuffer()
    buf.ids = [1, 2, 3]
    # New neighbours of 10: 11, 9 (20 tokens); old total 30 + 20 >= 35 -> refill: new first, then old from the end.
    assert buf.update([10], sizes, 35) == [3, 9, 11]


def test_event_index_exact_search_against_numpy():
    rng = np.random.default_rng(1)
    index = EventIndex(16, "exact")
    vectors = rng.normal(size=(50, 16)).astype(np.float32)
    index.add(vectors[:30], 0)
    index.add(vectors[30:], 30)
    q = rng.normal(size=16).astype(np.float32)
    want = np.argsort(-(vectors.astype(np.float64) @ q))[:7]
    np.testing.assert_array_equal(index.search(q, 7), want)
    with pytest.raises(ValueError, match="ids from 50"):
        index.add(vectors[:2], 10)


@pytest.mark.parametrize("kind", ["scann", "scann_auto"])
def test_event_index_scann_matches_exact(kind):
    rng = np.random.default_rng(2)
    vectors = rng.normal(size=(300, 8)).astype(np.float32)
    index = EventIndex(8, kind)
    for i in range(0, 300, 60):          # grows chunk by chunk, as during a stream
        index.add(vectors[i:i + 60], i)
        q = rng.normal(size=8).astype(np.float32)
        np.testing.assert_array_equal(index.search(q, 5), np.argsort(-(vectors[:i + 60] @ q))[:5])


def test_event_index_scann_exact_past_quantization_threshold():
    """Default ``scann`` stays exact where ``scann_auto`` switches to quantized search (> 20K events)."""
    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(25_000, 16)).astype(np.float32)
    index = EventIndex(16, "scann")
    index.add(vectors[:20_000], 0)
    index.add(vectors[20_000:], 20_000)
    for _ in range(5):
        q = rng.normal(size=16).astype(np.float32)
        np.testing.assert_array_equal(index.search(q, 8), np.argsort(-(vectors.astype(np.float64) @ q))[:8])
    assert index.index.params["mode"] == "brute_force"


def _store_with_events(sizes, layers=2, kv_heads=2, d=4, seed=0):
    rng = np.random.default_rng(seed)
    cfg = EMLLMConfig(index="exact")
    store = EventStore(layers, 8, cfg)
    ks = [rng.normal(size=(layers, s, kv_heads, d)).astype(np.float32) for s in sizes]
    vs = [rng.normal(size=(layers, s, kv_heads, d)).astype(np.float32) for s in sizes]
    store.add(list(np.cumsum([0] + sizes[:-1])), ks, vs, rng.normal(size=(len(sizes), layers, 8)))
    return store, ks, vs


def test_device_cache_lru_loads_only_missing_events():
    sizes = [3, 8, 5, 8, 2, 7]
    store, ks, vs = _store_with_events(sizes)
    cache = DeviceEventCache(2, slots=3, max_block_size=8, num_kv_heads=2, head_dim=4, dtype=jnp.float32)
    before = cache.nbytes
    slots = cache.load(1, [0, 2, 5], store)
    assert cache.loads == 3
    for event_id, slot in zip([0, 2, 5], slots):
        np.testing.assert_array_equal(np.asarray(cache.k[1][slot, :sizes[event_id]]), ks[event_id][1])
        np.testing.assert_array_equal(np.asarray(cache.v[1][slot, :sizes[event_id]]), vs[event_id][1])
    cache.load(1, [2, 5], store)
    assert cache.loads == 3                          # resident: no copy
    slots = cache.load(1, [3, 2], store)             # evicts event 0 (least recently used), keeps 2 and 5
    assert cache.loads == 4 and set(cache._resident[1]) == {2, 3, 5}
    np.testing.assert_array_equal(np.asarray(cache.k[1][slots[0], :8]), ks[3][1])
    assert cache.nbytes == before                    # fixed size
    with pytest.raises(ValueError, match="max_cached_events"):
        cache.load(0, [0, 1, 2, 3], store)
