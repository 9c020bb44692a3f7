"""The fused CPU kernels (``rag_jax/model/cpu_kernel.py``). ``cpu_attention.cc``: outputs and log-sum-exp
(forward) and dq / dk / dv (backward) equal the pure-JAX tile loops (``blockwise._forward`` / ``_backward``) on
every mask structure of ``test_attention_impls`` and on
head sizes taking each vector path (16, 48, 64, 128), ``blockwise_attention`` runs it on CPU, and the build is cached
by content. ``cpu_xent.cc``: the softmax cross-entropy gradient vs float64 NumPy. Skipped where no C++ compiler is
installed (CI installs g++)."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from rag_jax.model import blockwise, cpu_kernel
from rag_jax.model.masks import MaskSpec
from test_attention_impls import CASES, _case, _qkv

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="no C++ compiler: the JAX path runs instead")


def _both(q, k, v, spec):
    qt, kt, vt = blockwise.kernel_layout(q, k, v, 0, 0)
    fused = jax.jit(cpu_kernel.flash_forward)(qt, kt, vt, spec)
    classes = spec.chunk_classes(1, 1)
    plain = jax.jit(lambda *a: blockwise._forward(*a, classes, 1, 1))(qt, kt, vt, spec)
    return fused, plain


@pytest.mark.parametrize("name", CASES)
def test_fused_forward_equals_the_jax_tile_loop(name):
    rng = np.random.default_rng()
    q, k, v, spec = _case(name, rng)
    (out, lse), (ref, ref_lse) = _both(q, k, v, spec)
    assert float(jnp.abs(ref).max()) > 0.1
    np.testing.assert_allclose(out, ref, atol=2e-6, rtol=0)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5, rtol=1e-6)


def test_blockwise_attention_calls_the_fused_kernel_on_cpu_and_the_build_is_cached():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, 1, 40, 40)
    seg = jnp.ones((1, 40), jnp.int32)
    text = jax.jit(lambda q, k, v: blockwise.blockwise_attention(q, k, v, MaskSpec.create("causal", seg, seg))[0]
                   ).lower(q, k, v).as_text()
    assert cpu_kernel.TARGET in text
    lib = cpu_kernel._build(cpu_kernel._compiler())
    assert lib.is_file() and cpu_kernel._build(cpu_kernel._compiler()) == lib




@pytest.mark.parametrize("structure", ["block_last_block", "causal_window_over_cache"])
def test_fused_forward_splits_the_keys_of_few_query_blocks(structure):
    """One query block of one KV head over 6+ key tiles: the kernel splits the keys into ranges (FlashDecoding)
    and merges the partial softmaxes; equal to the JAX tile loop, including a padding query (lse = MASK_VALUE)
    and, with the window, rows whose keys all lie in one range."""
    rng = np.random.default_rng()
    cache_len, q_len = int(rng.integers(700, 900)), 50
    q, k, v = _qkv(rng, 1, q_len, cache_len + q_len, heads=3, kv_heads=1, d=64)
    cache_seg = (np.arange(cache_len) // 100 + 1).astype(np.int32)[None]
    cache_seg[0, rng.integers(0, cache_len, 40)] = 0                 # empty slots
    q_seg = np.full((1, q_len), int(cache_seg.max()) + 1, np.int32)
    q_seg[0, -3:] = 0                                                # padding queries
    kv_seg = np.concatenate([cache_seg, q_seg], 1)
    pos = np.arange(cache_len + q_len, dtype=np.int32)[None]
    if structure == "block_last_block":
        spec = MaskSpec.create("block", q_seg, kv_seg, q_is_global=np.ones((1, q_len), bool))
    else:
        spec = MaskSpec.create("causal", q_seg, kv_seg, q_positions=pos[:, cache_len:], kv_positions=pos,
                               sliding_window=int(rng.integers(20, 200)))
    (out, lse), (ref, ref_lse) = _both(q, k, v, spec)
    assert float(jnp.abs(ref).max()) > 0.1
    np.testing.assert_allclose(out, ref, atol=2e-6, rtol=0)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5, rtol=1e-6)
    assert (np.asarray(lse)[..., -3:] < blockwise.MASK_VALUE / 2).all()

def _both_grads(q, k, v, spec):
    """(dq, dk, dv) of the kernel-layout tensors through the fused backward and through the JAX tile loop, for
    fresh output and log-sum-exp cotangents (the joint-softmax merge differentiates lse too)."""
    qt, kt, vt = blockwise.kernel_layout(q, k, v, 0, 0)
    classes = spec.chunk_classes(1, 1)
    out, lse = jax.jit(lambda *a: blockwise._forward(*a, classes, 1, 1))(qt, kt, vt, spec)
    rng = np.random.default_rng()
    d_out = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    d_lse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32) * (lse > blockwise.MASK_VALUE / 2)
    delta = jnp.einsum("bhgqd,bhgqd->bhgq", d_out, out) - d_lse
    fused = jax.jit(cpu_kernel.flash_backward)(qt, kt, vt, spec, lse, d_out, delta)
    plain = jax.jit(lambda *a: blockwise._backward(*a, classes, 1, 1))(qt, kt, vt, spec, lse, d_out, delta)
    return fused, plain


def _assert_grads_close(fused, plain):
    for got, want in zip(fused, plain):
        assert float(jnp.abs(want).max()) > 0.05
        np.testing.assert_allclose(got, want, atol=2e-5 * float(jnp.abs(want).max()), rtol=0)


@pytest.mark.parametrize("name", CASES)
def test_fused_backward_equals_the_jax_tile_loop(name):
    _assert_grads_close(*_both_grads(*_case(name, np.random.default_rng())))


@pytest.mark.parametrize("d", [16, 48, 64, 128])
def test_fused_kernels_head_sizes_ragged_lengths_and_cache(d):
    """Both kernels on every vector path of the head size, ragged lengths over a cache, padding rows."""
    rng = np.random.default_rng()
    q_len, cache = int(rng.integers(70, 300)), int(rng.integers(0, 200))
    q, k, v = _qkv(rng, 2, q_len, q_len + cache, heads=6, kv_heads=2, d=d)
    q_seg, kv_seg = np.ones((2, q_len), np.int32), np.ones((2, q_len + cache), np.int32)
    q_seg[1, q_len - 5:] = kv_seg[1, q_len + cache - 5:] = 0
    spec = MaskSpec.create("causal", q_seg, kv_seg)
    (out, lse), (ref, ref_lse) = _both(q, k, v, spec)
    np.testing.assert_allclose(out, ref, atol=2e-6, rtol=0)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5, rtol=1e-6)
    assert not np.asarray(out)[1, :, :, q_len - 5:].any()          # padding queries: zero, as the JAX path
    fused, plain = _both_grads(q, k, v, spec)
    _assert_grads_close(fused, plain)
    assert not np.asarray(fused[0])[1, :, :, q_len - 5:].any()      # and no gradient


def _one_tile_reference(qt, kt, vt, spec, d_out, d_lse):
    """The JAX loops on a single tile covering everything (the mask evaluated on every pair)."""
    q_len, kv_len = qt.shape[3], kt.shape[2]
    classes = spec.chunk_classes(q_len, kv_len)
    out, lse = blockwise._forward(qt, kt, vt, spec, classes, q_len, kv_len)
    delta = jnp.einsum("bhgqd,bhgqd->bhgq", d_out, out) - d_lse
    return (out, lse), blockwise._backward(qt, kt, vt, spec, lse, d_out, delta, classes, q_len, kv_len), delta


@pytest.mark.parametrize("layout", ["block_last_block_global", "bidirectional_long_segments", "causal_long_window"])
def test_fused_kernels_where_whole_tiles_are_allowed(layout):
    """Kernel-sized tiles (64 queries x 128 keys) that the range test proves fully allowed (the question block
    of Block-Attention over cached passages, long packed segments, a window wider than a tile) take the
    unmasked path: forward and backward still equal the JAX loops."""
    rng = np.random.default_rng()
    if layout == "block_last_block_global":
        # three cached passages, then a new passage of `local` tokens (its own block) and the global question
        blocks, q_len, local = int(rng.integers(130, 200)), int(rng.integers(64, 140)), int(rng.integers(5, 30))
        kv_seg = np.concatenate([np.repeat([1, 2, 3], blocks), np.full(local, 4), np.full(q_len - local, 5)])
        kv_seg = kv_seg[None].astype(np.int32)
        spec = MaskSpec.create("block", kv_seg[:, -q_len:], kv_seg, q_is_global=kv_seg[:, -q_len:] == 5)
    elif layout == "bidirectional_long_segments":
        n = int(rng.integers(150, 260))
        q_len = 2 * n
        seg = np.repeat(np.array([1, 2], np.int32), n)[None]
        spec = MaskSpec.create("bidirectional", seg, seg)
    else:
        q_len = int(rng.integers(500, 700))
        seg = np.ones((1, q_len), np.int32)
        pos = np.arange(q_len, dtype=np.int32)[None]
        spec = MaskSpec.create("causal", seg, seg, q_positions=pos, kv_positions=pos, sliding_window=300)
    q, k, v = _qkv(rng, 1, q_len, spec.kv_len, heads=6, kv_heads=2, d=64)
    qt, kt, vt = blockwise.kernel_layout(q, k, v, 0, 0)
    d_out = jnp.asarray(rng.standard_normal(qt.shape), jnp.float32)
    d_lse = jnp.asarray(rng.standard_normal(qt.shape[:4]), jnp.float32)
    (ref, ref_lse), ref_grads, delta = jax.jit(_one_tile_reference, static_argnums=())(qt, kt, vt, spec, d_out, d_lse)
    out, lse = jax.jit(cpu_kernel.flash_forward)(qt, kt, vt, spec)
    np.testing.assert_allclose(out, ref, atol=2e-6, rtol=0)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5, rtol=1e-6)
    _assert_grads_close(jax.jit(cpu_kernel.flash_backward)(qt, kt, vt, spec, ref_lse, d_out, delta), ref_grads)


@pytest.mark.parametrize("vocab", [16, 50, 1000])
def test_softmax_xent_equals_float64_numpy(vocab):
    """``cpu_kernel.softmax_xent`` (``cpu_xent.cc``) vs float64 NumPy: the gradient ``w * (softmax - onehot)``,
    log-sum-exp, target logit and row max, on logits spread over +-40 (exp's range reduction and clamp), a vocab
    off the vector width (scalar tail), zero weights and a target outside the vocab (nothing subtracted)."""
    rng = np.random.default_rng()
    rows = 37
    logits = rng.uniform(-40, 40, (rows, vocab)).astype(np.float32)
    targets = rng.integers(0, vocab, rows).astype(np.int32)
    targets[3] = vocab                                        # out of range
    targets[5] = int(np.argmax(logits[5]))                    # target at the max
    weights = rng.uniform(0, 2, rows).astype(np.float32)
    weights[7] = 0.0
    dlogits, lse, target, top = jax.jit(cpu_kernel.softmax_xent)(logits, targets, weights)
    x = logits.astype(np.float64)
    m = x.max(-1)
    ref_lse = m + np.log(np.exp(x - m[:, None]).sum(-1))
    onehot = np.arange(vocab)[None] == targets[:, None]
    ref = weights[:, None] * (np.exp(x - ref_lse[:, None]) - onehot)
    np.testing.assert_allclose(dlogits, ref, atol=2e-6 * max(1.0, float(np.abs(ref).max())), rtol=0)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(top, logits.max(-1))
    valid = targets < vocab
    np.testing.assert_array_equal(target[valid], logits[valid, targets[valid]])
    assert np.isnan(target[3]) and np.all(dlogits[7] == 0)
