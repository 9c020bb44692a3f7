"""MagicPIG's LSH-sampled decode attention and the TopK baseline against float64 NumPy references: the analytic
inclusion probability, the sampling frequency it predicts, the unbiased estimator, error vs budget, generation."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rag_jax.inference import magicpig
from rag_jax.inference.generate import generate
from rag_jax.inference.magicpig import MagicPIGDecode, TopKDecode
from rag_jax.model import ModelConfig, Transformer
from rag_jax.model.attention import attend_cache
from rag_jax.model.kv import DecodeCache


def _case(rng, b=1, kv_heads=2, heads=4, length=48, d=16, filled=None, aligned=3):
    """A decode query over a cache whose first ``filled`` slots hold keys (the rest empty); ``aligned`` keys per
    head point near the query so attention is peaked, as in a real model."""
    filled = length if filled is None else filled
    q = rng.standard_normal((b, 1, heads, d))
    kt = rng.standard_normal((b, kv_heads, length, d))
    vt = rng.standard_normal((b, kv_heads, length, d))
    g = heads // kv_heads
    for h in range(kv_heads):
        for j in rng.choice(np.arange(6, filled - 6), aligned, replace=False):
            kt[:, h, j] = 2.5 * q[:, 0, h * g] + 0.3 * rng.standard_normal((b, d))
    seg = np.zeros((b, length), np.int32)
    seg[:, :filled] = 1
    cache = DecodeCache(k=(jnp.asarray(kt, jnp.float32),), v=(jnp.asarray(vt, jnp.float32),),
                        positions=jnp.broadcast_to(jnp.arange(length), (b, length)), segment_ids=jnp.asarray(seg))
    mask = jnp.asarray(seg[:, None, :] != 0)
    return jnp.asarray(q, jnp.float32), cache, mask, filled


def _tail(q_table, tables, t):
    return sum(math.comb(tables, j) * q_table ** j * (1 - q_table) ** (tables - j) for j in range(t, tables + 1))


@pytest.mark.parametrize("bits,tables,t", [(1, 1, 1), (4, 20, 2), (10, 150, 2), (6, 9, 4), (2, 40, 30), (3, 400, 5)])
def test_collision_probability_is_the_binomial_tail(bits, tables, t):
    cos = np.random.default_rng().uniform(-1, 1, 200)
    cos[:3] = (-1.0, 1.0, 0.999)
    q_table = (1 - np.arccos(cos) / np.pi) ** bits
    want = np.array([_tail(x, tables, t) for x in q_table])
    got = np.asarray(magicpig.collision_probability(jnp.asarray(cos, jnp.float32), bits, tables, t))
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-6)
    small = (want > 1e-30) & (want < 1e-3)              # relative accuracy where the estimator weight 1/u is large
    np.testing.assert_allclose(got[small], want[small], rtol=2e-3)
    assert got[1] == pytest.approx(1.0) and got[0] == pytest.approx(0.0, abs=1e-30)


def test_sampling_frequency_matches_the_inclusion_probability_and_the_estimate_is_unbiased():
    """Over random hyperplanes each middle key is sampled with probability u (so Σ_sampled w v / u is unbiased for
    Σ_middle w v), sinks and the local window never. Unpeaked attention: a dominant key with u near 1 makes the
    estimate heavy-tailed (a rare miss moves the mean by w/draws), which a normal interval does not cover."""
    rng = np.random.default_rng()
    cfg = MagicPIGDecode(bits=2, tables=6, min_collisions=2, sink_tokens=2, local_tokens=4)
    q, cache, mask, filled = _case(rng, aligned=0)
    draws = 1500
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), draws)
    sampled, u = jax.jit(jax.vmap(lambda key: cfg.sample(cfg.prepare(cache, filled, key), 0, q, cache.k[0])))(keys)
    sampled, u = np.asarray(sampled, np.float64), np.asarray(u[0], np.float64)    # [draws, b, h, g, T]
    middle = np.zeros(filled, bool)
    middle[2:filled - 4] = True
    assert sampled[..., ~middle].sum() == 0
    freq = sampled.mean(0)[..., middle]
    u_mid = u[..., middle]
    assert 0.05 < u_mid.mean() < 0.95
    np.testing.assert_array_less(np.abs(freq - u_mid), 4.5 * np.sqrt(u_mid * (1 - u_mid) / draws) + 2e-3)
    # Horvitz-Thompson numerator and denominator, float64, against the exact sums over the middle
    kt, vt = np.asarray(cache.k[0], np.float64), np.asarray(cache.v[0], np.float64)
    qg = np.asarray(q, np.float64).reshape(1, 2, 2, 16)
    w = np.exp(np.einsum("bhgd,bhkd->bhgk", qg, kt) / 4.0)[..., middle]
    vm = vt[:, :, middle]
    est = np.einsum("rbhgk,bhkd->rbhgd", sampled[..., middle] * w / u_mid, vm)
    exact = np.einsum("bhgk,bhkd->bhgd", w, vm)
    se = est.std(0) / np.sqrt(draws)
    # 6 sigma: importance weights have heavy tails
    np.testing.assert_array_less(np.abs(est.mean(0) - exact), 6 * se + 1e-9)
    den = (sampled[..., middle] * w / u_mid).sum(-1)
    np.testing.assert_array_less(np.abs(den.mean(0) - w.sum(-1)), 6 * den.std(0) / np.sqrt(draws) + 1e-9)


def _reference(q, cache, mask, cfg, index):
    """MagicPIG's estimator in float64 NumPy from the index's planes (codes, collisions and u recomputed)."""
    kt, vt = np.asarray(cache.k[0], np.float64), np.asarray(cache.v[0], np.float64)
    b, kvh, length, d = kt.shape
    qg = np.asarray(q, np.float64).reshape(b, kvh, -1, d)
    planes = np.asarray(index.planes, np.float64)
    seg = np.asarray(cache.segment_ids)
    middle = np.asarray(index.middle)
    mean = (kt * middle[:, None, :, None]).sum(2, keepdims=True) / middle.sum(1)[:, None, None, None]
    kc = kt - mean

    def codes(x):
        bits = (x @ planes > 0).reshape(*x.shape[:-1], cfg.tables, cfg.bits)
        return (bits * (1 << np.arange(cfg.bits))).sum(-1)
    count = (codes(qg)[:, :, :, None, :] == codes(kc)[:, :, None, :, :]).sum(-1)
    cos = np.einsum("bhgd,bhkd->bhgk", qg / np.linalg.norm(qg, axis=-1, keepdims=True),
                    kc / np.linalg.norm(kc, axis=-1, keepdims=True))
    u = np.vectorize(lambda c: _tail((1 - np.arccos(np.clip(c, -1, 1)) / np.pi) ** cfg.bits, cfg.tables,
                                     cfg.min_collisions))(cos)
    scores = np.einsum("bhgd,bhkd->bhgk", qg, kt) / np.sqrt(d)
    valid = (seg != 0)[:, None, None, :] & np.asarray(mask)[:, None]
    mid = middle[:, None, None, :]
    take = mid & (count >= cfg.min_collisions)
    weight = np.where(valid & ~mid, np.exp(scores), 0.0) + np.where(take, np.exp(scores) / np.maximum(u, 1e-300), 0.0)
    out = np.einsum("bhgk,bhkd->bhgd", weight, vt) / weight.sum(-1, keepdims=True)
    return out.reshape(b, 1, -1, d), take.sum() / mid.sum() / (kvh * qg.shape[2])   # share of middle keys used


@pytest.mark.parametrize("filled", [48, 37])
def test_attend_equals_float64_reference(filled):
    rng = np.random.default_rng()
    cfg = MagicPIGDecode(bits=3, tables=12, min_collisions=2, sink_tokens=3, local_tokens=5,
                         seed=int(rng.integers(1000)))
    q, cache, mask, filled = _case(rng, b=2, filled=filled)
    index = cfg.prepare(cache, filled)
    want, frac = _reference(q, cache, mask, cfg, index)
    assert 0.05 < frac < 0.95
    np.testing.assert_allclose(cfg.attend(index, 0, q, cache.k[0], cache.v[0], mask), want, atol=2e-5, rtol=1e-4)
    # hashed on the fly (EM-LLM's per-step memory): the same planes, centring and estimate
    on_the_fly = magicpig._softmax_values(magicpig.decode_logits(cfg, q, cache.k[0], mask, index.middle),
                                          cache.v[0], q)
    np.testing.assert_allclose(on_the_fly, want, atol=2e-5, rtol=1e-4)


def test_error_shrinks_with_the_number_of_tables():
    rng = np.random.default_rng()
    q, cache, mask, filled = _case(rng, length=256, aligned=4)
    exact = np.asarray(attend_cache(q, cache.k[0], cache.v[0], mask), np.float64)
    errors, fractions = [], []
    for tables in (2, 8, 32):
        cfg = MagicPIGDecode(bits=4, tables=tables, min_collisions=1, sink_tokens=4, local_tokens=8)

        def one(key):
            index = cfg.prepare(cache, filled, key)
            out = cfg.attend(index, 0, q, cache.k[0], cache.v[0], mask)
            return out, cfg.sample(index, 0, q, cache.k[0])[0].mean()
        outs, frac = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 40))
        rel = np.linalg.norm(np.asarray(outs) - exact, axis=-1) / np.linalg.norm(exact, axis=-1)
        errors.append(rel.mean())
        fractions.append(float(frac.mean()))
    assert fractions[0] < fractions[1] < fractions[2]
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.5 * errors[0]


def test_topk_equals_float64_reference_and_exact_at_full_budget():
    rng = np.random.default_rng()
    q, cache, mask, filled = _case(rng, b=2, filled=40)
    kt, vt = np.asarray(cache.k[0], np.float64), np.asarray(cache.v[0], np.float64)
    cfg = TopKDecode(budget=5, sink_tokens=3, local_tokens=4)
    middle = cfg.prepare(cache, filled)
    qg = np.asarray(q, np.float64).reshape(2, 2, 2, 16)
    scores = np.einsum("bhgd,bhkd->bhgk", qg, kt) / 4.0
    mid = np.zeros(48, bool)
    mid[3:36] = True
    kth = np.sort(np.where(mid, scores, -np.inf), -1)[..., -5:-4]
    keep = (mid & (scores >= kth)) | (~mid & (np.arange(48) < 40))
    w = np.where(keep, np.exp(scores), 0.0)
    want = (np.einsum("bhgk,bhkd->bhgd", w, vt) / w.sum(-1, keepdims=True)).reshape(2, 1, 4, 16)
    np.testing.assert_allclose(cfg.attend(middle, 0, q, cache.k[0], cache.v[0], mask), want, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(magicpig._softmax_values(magicpig.decode_logits(cfg, q, cache.k[0], mask, middle),
                                                        cache.v[0], q), want, atol=2e-5, rtol=1e-4)
    full = TopKDecode(budget=48, sink_tokens=3, local_tokens=4)
    np.testing.assert_allclose(full.attend(full.prepare(cache, filled), 0, q, cache.k[0], cache.v[0], mask),
                               attend_cache(q, cache.k[0], cache.v[0], mask), atol=1e-6)


def test_generate_with_decode_attention():
    model = Transformer(ModelConfig.tiny(vocab_size=200, max_seq_len=128), rngs=nnx.Rngs(0))
    prompts = np.random.default_rng().integers(0, 200, (2, 60))
    plain = generate(model, prompts, max_new_tokens=6)
    # no middle (sinks cover the prompt) / a budget above the middle: exactly the plain cache attention
    np.testing.assert_array_equal(generate(model, prompts, max_new_tokens=6,
                                           decode_attention=MagicPIGDecode(sink_tokens=64)), plain)
    np.testing.assert_array_equal(generate(model, prompts, max_new_tokens=6,
                                           decode_attention=TopKDecode(budget=128)), plain)
    sampled = generate(model, prompts, max_new_tokens=6, decode_attention=MagicPIGDecode(bits=4, tables=8))
    assert sampled.shape == (2, 6) and sampled.min() >= 0 and sampled.max() < 200
    every_layer_dense = tuple(range(model.config.num_layers))
    np.testing.assert_array_equal(generate(model, prompts, max_new_tokens=6, decode_attention=MagicPIGDecode(
        bits=4, tables=8, dense_layers=every_layer_dense)), plain)
    np.testing.assert_array_equal(generate(model, prompts, max_new_tokens=6, decode_attention=TopKDecode(
        budget=1, dense_layers=every_layer_dense)), plain)


def test_bucket_tables_hold_each_slot_in_its_bucket_once():
    rng = np.random.default_rng()
    bits = int(rng.integers(1, 5))
    codes = rng.integers(0, 2 ** bits, (2, 3, 40, 5)).astype(np.int32)
    order, offsets = (np.asarray(x) for x in magicpig.bucket_tables(jnp.asarray(codes), bits))
    for b, h, t in np.ndindex(2, 3, 5):
        assert offsets[b, h, t, 0] == 0 and offsets[b, h, t, -1] == 40
        for c in range(2 ** bits):
            got = order[b, h, t, offsets[b, h, t, c]:offsets[b, h, t, c + 1]]
            np.testing.assert_array_equal(got, np.flatnonzero(codes[b, h, :, t] == c))   # slot order kept


def test_compact_takes_the_first_true_slots_in_order():
    keep = np.random.default_rng().random((6, 30)) < 0.3
    for size in (1, 4, 30):
        idx, ok = (np.asarray(x) for x in magicpig._compact(jnp.asarray(keep), size))
        for r in range(6):
            want = np.flatnonzero(keep[r])[:size]
            np.testing.assert_array_equal(idx[r][ok[r]], want)
            assert ok[r].sum() == len(want) and not ok[r][len(want):].any()


def test_gathered_sampling_equals_the_dense_evaluation_when_nothing_is_cut():
    """Bucket tables with capacities at the cache length: the same sampled keys and weights as the dense
    evaluation (ragged rows, padding, sinks and window), so the same output; in generation the same tokens.
    Capacities below the largest bucket / sample change the estimate (keys are left out)."""
    rng = np.random.default_rng()
    q, cache, mask, filled = _case(rng, b=2, length=64, filled=int(rng.integers(40, 60)))
    seed = int(rng.integers(1000))
    for bits, tables in ((2, 6), (4, 12), (6, 20)):
        dense = MagicPIGDecode(bits=bits, tables=tables, sink_tokens=3, local_tokens=5, seed=seed)
        full = MagicPIGDecode(bits=bits, tables=tables, sink_tokens=3, local_tokens=5, seed=seed, bucket_size=64,
                              max_sampled=64)
        want = dense.attend(dense.prepare(cache, filled), 0, q, cache.k[0], cache.v[0], mask)
        got = full.attend(full.prepare(cache, filled), 0, q, cache.k[0], cache.v[0], mask)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    cut = MagicPIGDecode(bits=2, tables=6, sink_tokens=3, local_tokens=5, seed=seed, bucket_size=2, max_sampled=3)
    cut_out = cut.attend(cut.prepare(cache, filled), 0, q, cache.k[0], cache.v[0], mask)
    dense_out = dense.attend(dense.prepare(cache, filled), 0, q, cache.k[0], cache.v[0], mask)
    assert np.abs(np.asarray(cut_out) - np.asarray(dense_out)).max() > 1e-3
    model = Transformer(ModelConfig.tiny(vocab_size=200, max_seq_len=128), rngs=nnx.Rngs(0))
    prompts = [rng.integers(0, 200, int(n)).tolist() for n in (60, 47)]
    np.testing.assert_array_equal(
        generate(model, prompts, max_new_tokens=6, decode_attention=MagicPIGDecode(bits=4, tables=8, seed=seed)),
        generate(model, prompts, max_new_tokens=6, decode_attention=MagicPIGDecode(
            bits=4, tables=8, seed=seed, bucket_size=128, max_sampled=128)))


def test_sampled_slots_equal_a_numpy_count():
    """``_sampled_slots`` (scatter-add + compaction) against a NumPy count from the raw codes: per table the first
    ``bucket_size`` slots of the query's bucket, keys with at least ``min_collisions`` among ``keep``, the first
    ``max_sampled`` in slot order; with and without cuts."""
    rng = np.random.default_rng()
    b, h, g, n = 2, int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(20, 90))
    bits, tables = int(rng.integers(1, 4)), int(rng.integers(3, 12))
    k_codes = rng.integers(0, 2 ** bits, (b, h, n, tables)).astype(np.int32)
    q_codes = rng.integers(0, 2 ** bits, (b, h, g, tables)).astype(np.int32)
    keep = rng.random((b, n)) < 0.8
    order, offsets = magicpig.bucket_tables(jnp.asarray(k_codes), bits)
    for bucket_size, max_sampled, min_collisions in ((n, n, 1), (n, n, 2), (2, 3, 1),
                                                     (int(rng.integers(1, n)), int(rng.integers(1, n)), 2)):
        counts = np.zeros((b, h, g, n), int)
        for bi, hi, gi, t in np.ndindex(b, h, g, tables):
            counts[bi, hi, gi, np.flatnonzero(k_codes[bi, hi, :, t] == q_codes[bi, hi, gi, t])[:bucket_size]] += 1
        want = (counts >= min_collisions) & keep[:, None, None, :]
        cfg = MagicPIGDecode(bits=bits, tables=tables, min_collisions=min_collisions, bucket_size=bucket_size,
                             max_sampled=max_sampled)
        idx, ok = (np.asarray(x) for x in cfg._sampled_slots(jnp.asarray(q_codes), order, offsets,
                                                             jnp.asarray(keep)))
        assert idx.shape == ok.shape == (b * h * g, min(max_sampled, n))
        for r, w in enumerate(want.reshape(b * h * g, n)):
            np.testing.assert_array_equal(idx[r][ok[r]], np.flatnonzero(w)[:max_sampled])
            assert not ok[r][ok[r].sum():].any()


def test_cpu_kernel_step_equals_the_jax_gathered_path(monkeypatch):
    """On CPU the bucket-table step runs as one C++ kernel (``cpu_kernel.lsh_attend``); the JAX path (tested equal
    to the dense evaluation above) is the reference: the same output with and without capacity cuts, GQA groups,
    a row whose mask hides part of its prompt."""
    from rag_jax.model import cpu_kernel
    if not cpu_kernel.available():
        pytest.skip("the C++ kernels are not built here (no compiler)")
    rng = np.random.default_rng()
    length = int(rng.integers(64, 160))
    q, cache, mask, filled = _case(rng, b=2, kv_heads=2, heads=int(rng.choice([2, 4, 6])), length=length,
                                   d=int(rng.choice([16, 32])), filled=int(rng.integers(40, length)))
    mask = mask.at[1, 0, filled - int(rng.integers(1, 20)):].set(False)
    seed = int(rng.integers(1000))
    for bits, tables, mc, bucket_size, max_sampled in ((2, 6, 2, length, length), (4, 12, 1, length, length),
                                                       (3, 10, 2, 3, 5), (int(rng.integers(1, 6)),
                                                        int(rng.integers(2, 20)), 2, int(rng.integers(1, 40)),
                                                        int(rng.integers(1, 40)))):
        cfg = MagicPIGDecode(bits=bits, tables=tables, min_collisions=mc, sink_tokens=3, local_tokens=5, seed=seed,
                             bucket_size=bucket_size, max_sampled=max_sampled)
        index = cfg.prepare(cache, filled)
        got = np.asarray(cfg.attend(index, 0, q, cache.k[0], cache.v[0], mask))
        monkeypatch.setattr(magicpig.cpu_kernel, "available", lambda: False)
        want = np.asarray(cfg.attend(index, 0, q, cache.k[0], cache.v[0], mask))
        monkeypatch.undo()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(bucket_size=8), "bucket_size=8 and max_sampled=0 must both be 0"), (dict(max_sampled=-1), "max_sampled=-1"),
    (dict(bits=0), "bits=0 must be an integer >= 1"), (dict(bits=31), "bits=31 must be <= 30"),
    (dict(tables=2.5), "tables=2.5 must be an integer"), (dict(tables=4, min_collisions=5), "min_collisions=5"),
    (dict(sink_tokens=-1), "sink_tokens=-1"), (dict(local_tokens=True), "local_tokens=True"),
    (dict(dense_layers=[0]), "dense_layers=\\[0\\] must be a tuple")])
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MagicPIGDecode(**kwargs)


def test_bad_topk_budget():
    with pytest.raises(ValueError, match="budget=-1 must be an integer >= 0"):
        TopKDecode(budget=-1)
