"""Masks, RoPE, KV segments, attention and input validation of the core model, against float64 NumPy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rag_jax.model import KVSegment, ModelConfig, Transformer, apply_rope, attend, attend_joint, build_mask, key_mass
from rag_jax.model import count_params, jit_forward, rope_inv_freq

RNG = np.random.default_rng(1234)


def _np_mask(mode, q_seg, kv_seg, q_glob, q_order, kv_order):
    """Float64-free reference: loops over the definitions in masks.py's docstring."""
    b, ql = q_seg.shape
    kl = kv_seg.shape[1]
    out = np.zeros((b, ql, kl), bool)
    for n in range(b):
        for i in range(ql):
            for j in range(kl):
                if q_seg[n, i] == 0 or kv_seg[n, j] == 0:
                    continue
                if mode == "bidirectional":
                    out[n, i, j] = q_seg[n, i] == kv_seg[n, j]
                elif mode == "causal":
                    out[n, i, j] = kv_order[j] <= q_order[i]
                else:
                    out[n, i, j] = kv_order[j] <= q_order[i] and (q_seg[n, i] == kv_seg[n, j] or q_glob[n, i])
    return out


@pytest.mark.parametrize("mode", ["causal", "bidirectional", "block"])
@pytest.mark.parametrize("cache_len", [0, 5])
def test_mask_matches_numpy_reference(mode, cache_len):
    for _ in range(3):
        q_len = int(RNG.integers(4, 12))
        kv_seg = np.sort(RNG.integers(0, 4, (2, cache_len + q_len)), axis=1).astype(np.int32)
        q_seg = kv_seg[:, cache_len:]
        q_glob = RNG.random((2, q_len)) < 0.3
        got = build_mask(mode, jnp.asarray(q_seg), jnp.asarray(kv_seg), q_is_global=jnp.asarray(q_glob))
        want = _np_mask(mode, q_seg, kv_seg, q_glob, cache_len + np.arange(q_len), np.arange(cache_len + q_len))
        np.testing.assert_array_equal(np.asarray(got), want)


def test_sliding_window_mask():
    seg = jnp.ones((1, 6), jnp.int32)
    pos = jnp.arange(6)[None]
    m = np.asarray(build_mask("causal", seg, seg, q_positions=pos, kv_positions=pos, sliding_window=2))
    want = np.array([[j <= i and i - j < 2 for j in range(6)] for i in range(6)])
    np.testing.assert_array_equal(m[0], want)
    with pytest.raises(ValueError, match="mode='diagonal'"):
        build_mask("diagonal", seg, seg)


def test_rope_matches_float64_rotation():
    d = 16
    inv = rope_inv_freq(d, 10000.0)
    x = RNG.standard_normal((2, 5, 3, d))
    pos = RNG.integers(0, 5000, (2, 5))
    got = np.asarray(apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), inv))
    freqs = 1.0 / 10000.0 ** (np.arange(0, d, 2) / d)
    ang = pos[..., None, None] * freqs  # [b, s, 1, d/2]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    want = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)
    assert np.abs(got - want).max() < 2e-3  # float32 angles at positions up to 5000
    # Rotating by a then b equals rotating by a + b (what re-encoding pre-RoPE keys relies on).
    twice = apply_rope(apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), inv), jnp.full((2, 5), 7), inv)
    once = apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos + 7), inv)
    assert np.abs(np.asarray(twice) - np.asarray(once)).max() < 2e-3


def _np_attention(q, k, v, mask):
    g = q.shape[2] // k.shape[2]
    k = np.repeat(k, g, axis=2)
    v = np.repeat(v, g, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    logits = np.where(mask[:, None], logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", w, v)


def test_attend_and_joint_softmax_match_numpy():
    q = RNG.standard_normal((2, 6, 4, 8))
    k1, v1 = RNG.standard_normal((2, 9, 2, 8)), RNG.standard_normal((2, 9, 2, 8))
    k2, v2 = RNG.standard_normal((2, 5, 2, 8)), RNG.standard_normal((2, 5, 2, 8))
    m1, m2 = RNG.random((2, 6, 9)) < 0.7, RNG.random((2, 6, 5)) < 0.7
    m1[..., 0] = True
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    got = attend_joint([(f(q), f(k1), f(v1), jnp.asarray(m1)), (f(q), f(k2), f(v2), jnp.asarray(m2))])
    want = _np_attention(q, np.concatenate([k1, k2], 1), np.concatenate([v1, v2], 1), np.concatenate([m1, m2], -1))
    assert np.abs(np.asarray(got) - want).max() < 1e-5
    np.testing.assert_allclose(np.asarray(attend(f(q), f(k1), f(v1), jnp.asarray(m1))),
                               _np_attention(q, k1, v1, m1), atol=1e-5)
    # return_lse + key_mass with identity query weights: the same output and the float64 softmax weights,
    # keys in group order.
    groups = [(f(q), f(k1), f(v1), jnp.asarray(m1)), (f(q), f(k2), f(v2), jnp.asarray(m2))]
    out, lse = attend_joint(groups, return_lse=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(got))
    eye = jnp.broadcast_to(jnp.eye(6), (2, 6, 6))
    w = np.concatenate([np.asarray(key_mass(gq, gk, gm, lse, eye)) for gq, gk, _, gm in groups], -1)
    k, m = np.repeat(np.concatenate([k1, k2], 1), 2, axis=2), np.concatenate([m1, m2], -1)
    logits = np.where(m[:, None], np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8), -np.inf)
    want_w = np.exp(logits - logits.max(-1, keepdims=True))
    want_w /= want_w.sum(-1, keepdims=True)                       # [b, heads, q, k]
    assert w.shape == (2, 6, 4, 14)                               # [b, n = q, heads, k]
    np.testing.assert_allclose(w.transpose(0, 2, 1, 3), want_w, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse).reshape(2, 4, 6),
                               np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1),
                               atol=1e-5)


@pytest.fixture(scope="module")
def model():
    return Transformer(ModelConfig.tiny(vocab_size=300, max_seq_len=64), rngs=nnx.Rngs(3))


def _inputs(b, s, vocab, seed=0):
    r = np.random.default_rng(seed)
    return (jnp.asarray(r.integers(0, vocab, (b, s))), jnp.broadcast_to(jnp.arange(s), (b, s)),
            jnp.ones((b, s), jnp.int32))


def test_bidirectional_sees_the_future_causal_does_not(model):
    tokens, pos, seg = _inputs(1, 12, 300)
    changed = tokens.at[0, 10].set((tokens[0, 10] + 1) % 300)
    for mode, should_change in (("causal", False), ("bidirectional", True)):
        h0 = model(tokens, pos, seg, mode=mode).hidden[0, 2]
        h1 = model(changed, pos, seg, mode=mode).hidden[0, 2]
        assert bool(jnp.abs(h0 - h1).max() > 1e-4) == should_change, mode


@pytest.mark.parametrize("mode", ["causal", "block"])
def test_kv_segments_equal_full_forward(model, mode):
    """Attending over cached segments == one forward over the concatenation with the same mask."""
    model = jit_forward(model)
    r = np.random.default_rng(5)
    lens = [int(x) for x in r.integers(3, 9, 3)]
    total = sum(lens) + 6
    tokens, pos, _ = _inputs(2, total, 300, seed=9)
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lens)] + [np.full(6, 9)])
    seg = jnp.asarray(np.broadcast_to(seg, (2, total)), jnp.int32)
    glob = jnp.asarray(np.broadcast_to(np.arange(total) >= sum(lens), (2, total)))
    full = model(tokens, pos, seg, mode=mode, is_global=glob)
    cached, start = [], 0
    for n in lens:
        sl = slice(start, start + n)
        prev = KVSegment.concat(cached) if cached and mode == "causal" else None
        out = model(tokens[:, sl], pos[:, sl], seg[:, sl], mode=mode, kv_cache=prev)
        cached.append(out.kv)
        start += n
    last = model(tokens[:, start:], pos[:, start:], seg[:, start:], mode=mode, is_global=glob[:, start:],
                 kv_cache=KVSegment.concat(cached))
    assert np.abs(np.asarray(last.logits) - np.asarray(full.logits[:, start:])).max() <= 1e-5
    if mode == "block":  # blocks computed alone at local positions, re-encoded to their offsets
        local = []
        start = 0
        for n in lens:
            sl = slice(start, start + n)
            seg_kv = model(tokens[:, sl], pos[:, :n], seg[:, sl], mode=mode).kv
            local.append(seg_kv.with_positions(seg_kv.positions + start))
            start += n
        again = model(tokens[:, start:], pos[:, start:], seg[:, start:], mode=mode, is_global=glob[:, start:],
                      kv_cache=KVSegment.concat(local))
        assert np.abs(np.asarray(again.logits) - np.asarray(full.logits[:, start:])).max() <= 1e-5


def test_padding_is_ignored(model):
    tokens, pos, seg = _inputs(1, 10, 300, seed=2)
    base = model(tokens, pos, seg).logits[0, -1]
    padded = jnp.concatenate([jnp.full((1, 4), 7), tokens], 1)
    pos_p = jnp.concatenate([jnp.zeros((1, 4), jnp.int32), pos], 1)
    seg_p = jnp.concatenate([jnp.zeros((1, 4), jnp.int32), seg], 1)
    out = model(padded, pos_p, seg_p).logits
    assert not np.isnan(np.asarray(out)).any()
    assert np.abs(np.asarray(out[0, -1] - base)).max() < 1e-5


def test_llama3_8b_param_count_without_allocating():
    assert count_params(ModelConfig.preset("llama3-8b")) == 8_030_261_248


def test_bad_inputs_raise_clear_errors(model):
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=8; use one of"):
        ModelConfig(num_heads=8, num_kv_heads=3, hidden_size=64)
    with pytest.raises(ValueError, match="rope_type='yarn'.*valid"):
        ModelConfig(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    tokens, pos, seg = _inputs(1, 65, 300)
    with pytest.raises(ValueError, match="sequence length 65 exceeds .*max_seq_len=64"):
        model(tokens, pos, seg)
    tokens, pos, seg = _inputs(1, 8, 300)
    with pytest.raises(ValueError, match=r"token id 300 is outside the vocabulary \[0, vocab_size=300\)"):
        model(tokens.at[0, 3].set(300), pos, seg)
    with pytest.raises(TypeError, match="integer"):
        model(tokens.astype(jnp.float32), pos, seg)
    with pytest.raises(ValueError, match="mode='sideways'"):
        model(tokens, pos, seg, mode="sideways")
    with pytest.raises(ValueError, match="positions shape"):
        model(tokens, pos[:, :4], seg)
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.preset("gpt5")


def test_jit_functional_forward_matches_eager(model):
    graphdef, state = nnx.split(model)
    tokens, pos, seg = _inputs(2, 16, 300, seed=4)

    @jax.jit
    def fwd(state, tokens):
        return nnx.merge(graphdef, state)(tokens, pos, seg).logits

    np.testing.assert_allclose(np.asarray(fwd(state, tokens)), np.asarray(model(tokens, pos, seg).logits),
                               atol=1e-5)


_CONCAT_PROBE = """
import jax, jax.numpy as jnp, numpy as np
from rag_jax.model import kv
assert jax.device_count() == 1, jax.devices()
calls, from_dlpack = [], jnp.from_dlpack
jnp.from_dlpack = lambda x: calls.append(True) or from_dlpack(x)   # counts the host path's hand-over
rng = np.random.default_rng()
for dtype in ("float32", "int32", "bfloat16"):
    lengths = rng.integers(1, 40, size=rng.integers(2, 6))
    parts = [(rng.standard_normal((3, 1, int(n), 2, 16)) * 100).astype(jnp.dtype(dtype)) for n in lengths]
    want = np.concatenate(parts, axis=2)
    for limit in (0, 1 << 40):                        # 0: the host path wherever it applies; huge: XLA's
        kv.HOST_CONCAT_BYTES = limit
        got = kv.concatenate([jnp.asarray(p) for p in parts], axis=2)
        assert got.dtype == jnp.dtype(dtype) and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)
        host = limit == 0 and dtype != "bfloat16"     # bfloat16 is not NumPy's own dtype: XLA's path
        assert calls == ([True] if host else []), (dtype, limit, calls)
        calls.clear()
        assert got.unsafe_buffer_pointer() % 64 == 0
        doubled = jax.jit(lambda x: x * 2, donate_argnums=0)(got)
        np.testing.assert_array_equal(np.asarray(doubled), want * 2)
    traced = jax.jit(lambda xs: kv.concatenate(xs, axis=2))([jnp.asarray(p) for p in parts])
    np.testing.assert_array_equal(np.asarray(traced), want)
print("ok")
"""


def test_kv_concatenate_equals_numpy_on_the_host_path_and_the_xla_path():
    """``kv.concatenate`` in a one-device process (the host copy: CPU, concrete, >= HOST_CONCAT_BYTES; and XLA's
    concatenate) gives NumPy's values, 64-byte aligned, usable under jit and after donation; here, with 8 devices,
    the result follows its inputs as XLA's does (uncommitted inputs, uncommitted result)."""
    import os
    import subprocess
    import sys
    from rag_jax.model import kv
    env = {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", _CONCAT_PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
    assert jax.device_count() > 1
    parts = [jnp.asarray(np.random.default_rng().standard_normal((2, 1, 300, 2, 256)), jnp.float32) for _ in range(2)]
    got = kv.concatenate(parts, axis=2)                  # > HOST_CONCAT_BYTES, but several devices: XLA's path
    other = jax.device_put(jnp.ones(got.shape, got.dtype), jax.devices()[1])
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, y: x + y)(got, other)),
                                  np.concatenate([np.asarray(p) for p in parts], axis=2) + 1)
