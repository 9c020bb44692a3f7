"""Every attention path equals the dense reference (fp32, outputs and gradients), the structural mask
spec equals an independent NumPy mask, tile classes are sound (never skip an allowed pair, never
drop the mask of a masked pair), and the
implementation selection per backend (rag_jax/model/attention.py, blockwise.py, kernels.py, masks.py)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rag_jax.model import KVSegment, ModelConfig, Transformer, attention, jit_forward, kernels
from rag_jax.model.attention import attend, attend_joint, key_mass, resolve_impl
from rag_jax.model.blockwise import blockwise_attention
from rag_jax.model.masks import FULL, SKIP, MaskSpec

TOL = 1e-5
CHUNKS = dict(q_chunk=8, kv_chunk=5)  # small tiles: many tiles, ragged ends, skipped tiles, edge-touching tiles


def _qkv(rng, b, q_len, kv_len, heads=4, kv_heads=2, d=16):
    def arr(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)
    return arr(b, q_len, heads, d), arr(b, kv_len, kv_heads, d), arr(b, kv_len, kv_heads, d)


def _case(name, rng):
    """(q, k, v, spec) for a named structure; fresh random values and segment layouts."""
    b = 2
    if name == "causal_right_padding":
        L = 45
        seg = np.ones((b, L), np.int32)
        seg[1, rng.integers(20, 40):] = 0
        return (*_qkv(rng, b, L, L), MaskSpec.create("causal", seg, seg))
    if name == "bidirectional_packed":
        L = 40
        seg = np.repeat(np.arange(1, 5), 10)[None].repeat(b, 0).astype(np.int32)
        seg[0, 33:] = 0
        return (*_qkv(rng, b, L, L), MaskSpec.create("bidirectional", seg, seg))
    if name in ("block_cache_reencoded", "causal_window_cache"):
        # cached KV segments (blocks 1..3, empty slots 0) at re-encoded positions, then 21 new tokens
        cache_len, q_len = 30, 21
        cache_seg = np.repeat(np.array([1, 2, 3], np.int32), 10)[None].repeat(b, 0)
        cache_seg[1, 25:] = 0
        q_seg = np.full((b, q_len), 4, np.int32)
        q_seg[1, 17:] = 0
        cache_pos = np.tile(np.arange(cache_len), (b, 1)) + rng.integers(0, 3, (b, 1))
        q_pos = cache_pos[:, -1:] + 1 + np.arange(q_len)
        kv_seg, kv_pos = np.concatenate([cache_seg, q_seg], 1), np.concatenate([cache_pos, q_pos], 1)
        q, k, v = _qkv(rng, b, q_len, cache_len + q_len)
        if name == "causal_window_cache":
            spec = MaskSpec.create("causal", q_seg, kv_seg, q_positions=q_pos, kv_positions=kv_pos, sliding_window=13)
        else:
            is_global = np.zeros((b, q_len), bool)
            is_global[:, 11:] = True  # the new tokens: a local block then the global suffix
            q_seg[:, 11:] = 5
            q_seg[1, 17:] = 0
            kv_seg = np.concatenate([cache_seg, q_seg], 1)
            spec = MaskSpec.create("block", q_seg, kv_seg, q_is_global=is_global)
        return q, k, v, spec
    if name == "block_packed_window":
        L = 48
        seg = np.repeat(np.arange(1, 4), 16)[None].repeat(b, 0).astype(np.int32)
        seg[1, 40:] = 0
        pos = np.tile(np.arange(L), (b, 1))
        return (*_qkv(rng, b, L, L), MaskSpec.create("block", seg, seg, q_positions=pos, kv_positions=pos,
                                                     sliding_window=7))
    raise KeyError(name)


CASES = ["causal_right_padding", "bidirectional_packed", "block_cache_reencoded", "causal_window_cache",
         "block_packed_window"]


def _valid(spec):
    return jnp.asarray(spec.q_segment_ids != 0)[:, :, None, None]


def _grads(fn, q, k, v, ct):
    return jax.jit(jax.value_and_grad(lambda q, k, v: (fn(q, k, v) * ct).sum(), argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("name", CASES)
def test_blockwise_equals_dense_outputs_and_gradients(name):
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    q, k, v, spec = _case(name, rng)
    ct = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * _valid(spec)
    dense = attend(q, k, v, spec, impl="dense")
    block = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, spec, **CHUNKS)[0])(q, k, v)
    assert float(jnp.abs(dense).max()) > 0.1
    np.testing.assert_allclose(block, dense, atol=TOL, rtol=0)
    assert not np.asarray(block)[~np.asarray(spec.q_segment_ids != 0)].any()  # padding queries: zero
    (_, g_dense), (_, g_block) = (_grads(f, q, k, v, ct) for f in (
        lambda q, k, v: attend(q, k, v, spec, impl="dense"),
        lambda q, k, v: blockwise_attention(q, k, v, spec, **CHUNKS)[0]))
    for a, b in zip(g_block, g_dense):
        assert float(jnp.abs(b).max()) > 1e-3
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)


def test_default_long_tiles_forward_and_retiled_backward_equal_dense():
    """From LONG_FROM tokens the forward runs LONG_TILE tiles and the backward re-tiles to TILE: both equal the
    dense reference (block mode, packed segments, a ragged length, right padding in one row)."""
    from rag_jax.model import blockwise
    rng = np.random.default_rng()
    L = blockwise.LONG_FROM + int(rng.integers(1, blockwise.LONG_TILE - 1))
    seg = np.repeat(np.arange(1, L // 300 + 2), 300)[:L][None].repeat(2, 0).astype(np.int32)
    seg[1, L - int(rng.integers(10, 400)):] = 0
    is_global = np.zeros((2, L), bool)
    is_global[:, -200:] = True
    spec = MaskSpec.create("block", seg, seg, q_is_global=is_global)
    q, k, v = _qkv(rng, 2, L, L, heads=2, kv_heads=1, d=8)
    ct = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * _valid(spec)
    (val_d, g_dense), (val_b, g_block) = (_grads(f, q, k, v, ct) for f in (
        lambda q, k, v: attend(q, k, v, spec, impl="dense"),
        lambda q, k, v: blockwise_attention(q, k, v, spec)[0]))
    # the value is a float32 sum of ~1e5 terms of either sign (rounding ~1e-5 seen on a value ~0.5): absolute
    np.testing.assert_allclose(val_b, val_d, atol=1e-4, rtol=0)
    for a, b in zip(g_block, g_dense):
        assert float(jnp.abs(b).max()) > 1e-3
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
    out = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, spec)[0])(q, k, v)
    np.testing.assert_allclose(out, attend(q, k, v, spec, impl="dense"), atol=TOL, rtol=0)


def test_blockwise_through_dispatch_and_jit():
    rng = np.random.default_rng(1)
    q, k, v, spec = _case("block_cache_reencoded", rng)
    out = jax.jit(lambda q, k, v, s: attend(q, k, v, s, impl="blockwise"))(q, k, v, spec)
    np.testing.assert_allclose(out, attend(q, k, v, spec, impl="dense"), atol=TOL, rtol=0)


def _numpy_mask(spec):
    """Independent NumPy statement of masks.py's predicate."""
    s = {f: np.asarray(getattr(spec, f)) for f in ("q_segment_ids", "kv_segment_ids", "q_order", "kv_order",
                                                     "q_positions", "kv_positions", "q_is_global")}
    qs, ks = s["q_segment_ids"][:, :, None], s["kv_segment_ids"][:, None, :]
    m = (qs != 0) & (ks != 0)
    before = s["kv_order"][:, None, :] <= s["q_order"][:, :, None]
    if spec.mode == "causal":
        m &= before
    elif spec.mode == "bidirectional":
        m &= qs == ks
    else:
        m &= before & ((qs == ks) | s["q_is_global"][:, :, None])
    if spec.sliding_window is not None:
        m &= s["q_positions"][:, :, None] - s["kv_positions"][:, None, :] < spec.sliding_window
    return m


@pytest.mark.parametrize("name", CASES)
def test_spec_mask_and_chunk_skipping_are_sound(name):
    rng = np.random.default_rng(7)
    *_, spec = _case(name, rng)
    dense = np.asarray(spec.dense())
    np.testing.assert_array_equal(dense, _numpy_mask(spec))
    full_tiles = 0
    for qc, kc in ((8, 5), (16, 8), (7, 3), (5, 11)):
        Q, K = -(-spec.q_len // qc) * qc, -(-spec.kv_len // kc) * kc
        classes = np.asarray(spec.pad(Q, K).chunk_classes(qc, kc))
        tiles = np.pad(dense, ((0, 0), (0, Q - spec.q_len), (0, K - spec.kv_len)))
        tiles = tiles.reshape(dense.shape[0], Q // qc, qc, K // kc, kc).transpose(1, 3, 0, 2, 4)
        tiles = tiles.reshape(Q // qc, K // kc, -1)
        assert not (tiles.any(-1) & (classes == SKIP)).any(), f"a needed tile was skipped ({qc=}, {kc=})"
        assert not (~tiles.all(-1) & (classes == FULL)).any(), f"a tile with masked pairs is FULL ({qc=}, {kc=})"
        assert (classes == SKIP).any(), "structure should let some tiles be skipped"
        full_tiles += int((classes == FULL).sum())
    if name in ("causal_right_padding", "bidirectional_packed"):
        assert full_tiles > 0, "tiles inside one segment / below the diagonal should be FULL"


def test_causal_tiles_above_the_diagonal_are_skipped_below_unmasked():
    seg = np.ones((1, 64), np.int32)
    classes = np.asarray(MaskSpec.create("causal", seg, seg).chunk_classes(16, 16))
    np.testing.assert_array_equal(classes, np.tril(np.full((4, 4), FULL)) - np.eye(4, dtype=int))  # diagonal PARTIAL


def test_joint_groups_merge_by_logsumexp():
    rng = np.random.default_rng(3)
    b = 1
    q1, k1, v1, s1 = _case("causal_window_cache", rng)
    q1, k1, v1 = q1[:b], k1[:b], v1[:b]
    s1 = jax.tree.map(lambda x: x[:b], s1)
    q2 = jnp.asarray(rng.normal(size=q1.shape), jnp.float32)
    _, k2, v2 = _qkv(rng, b, q1.shape[1], 19)
    mem_seg = (rng.random((b, 19)) < 0.8).astype(np.int32)
    s2 = MaskSpec.create("bidirectional", np.ones((b, q1.shape[1]), np.int32), mem_seg)
    groups = lambda q1, k1, v1, q2, k2, v2: [(q1, k1, v1, s1), (q2, k2, v2, s2)]  # noqa: E731
    args = (q1, k1, v1, q2, k2, v2)
    ct = jnp.asarray(rng.normal(size=q1.shape), jnp.float32)
    def f(impl):
        return lambda *a: attend_joint(groups(*a), impl=impl)

    def vg(impl):
        return jax.jit(jax.value_and_grad(lambda *a: (f(impl)(*a) * ct).sum(), argnums=tuple(range(6))))(*args)
    np.testing.assert_allclose(jax.jit(f("blockwise"))(*args), f("dense")(*args), atol=TOL, rtol=0)
    (_, g_dense), (_, g_block) = vg("dense"), vg("blockwise")
    for a, b_ in zip(g_block, g_dense):
        np.testing.assert_allclose(a, b_, atol=TOL, rtol=0)
    # the joint lse from the blockwise merge equals the dense one, and key_mass over both groups sums to one on
    # every query row (each sees some memory key): EM-LLM's statistics from the blockwise path
    (_, lse_block), (_, lse_dense) = (attend_joint(groups(*args), return_lse=True, impl=i)
                                      for i in ("blockwise", "dense"))
    np.testing.assert_allclose(lse_block, lse_dense, atol=TOL, rtol=1e-6)
    eye = jnp.broadcast_to(jnp.eye(q1.shape[1]), (b, q1.shape[1], q1.shape[1]))
    total = sum(key_mass(gq, gk, gm, lse_block, eye).sum(-1) for gq, gk, _, gm in groups(*args))  # [b, q, heads]
    np.testing.assert_allclose(np.asarray(total), 1.0, atol=1e-5)


@pytest.mark.parametrize("window", [None, 9])
def test_cudnn_mapping_equals_dense(window):
    """The lengths / causal / window mapping handed to cuDNN, run by XLA's implementation on CPU."""
    rng = np.random.default_rng(5)
    b, L = 2, 37
    q, k, v = _qkv(rng, b, L, L, d=32)
    seg = np.ones((b, L), np.int32)
    seg[0, 29:] = 0
    pos = np.tile(np.arange(L), (b, 1)) + 5
    spec = MaskSpec.create("causal", seg, seg, q_positions=pos, kv_positions=pos, sliding_window=window)
    assert bool(kernels.cudnn_values_ok(spec))
    out = kernels.cudnn_attention(q, k, v, spec, implementation="xla")
    np.testing.assert_allclose(out, attend(q, k, v, spec, impl="dense"), atol=TOL, rtol=0)


def test_cudnn_selection():
    rng = np.random.default_rng(6)
    q, k, v, spec = _case("causal_right_padding", rng)
    assert not kernels.cudnn_expressible(q, spec)                      # fp32: no cuDNN kernel
    assert kernels.cudnn_expressible(q.astype(jnp.bfloat16), spec)
    assert bool(kernels.cudnn_values_ok(spec))
    left = np.ones((2, 45), np.int32)
    left[0, :4] = 0                                                    # left padding: not lengths
    assert not bool(kernels.cudnn_values_ok(MaskSpec.create("causal", left, left)))
    packed = _case("bidirectional_packed", rng)[3]
    assert not kernels.cudnn_expressible(q.astype(jnp.bfloat16), packed)
    cached = _case("causal_window_cache", rng)
    assert not kernels.cudnn_expressible(cached[0].astype(jnp.bfloat16), cached[3])  # q_len != kv_len
    # off-GPU fallback is exact: cudnn_or_blockwise on an inexpressible spec runs blockwise
    np.testing.assert_allclose(kernels.cudnn_or_blockwise(q, k, v, spec), attend(q, k, v, spec, impl="dense"),
                               atol=TOL, rtol=0)
    assert kernels.splash_expressible(spec) and not kernels.splash_expressible(cached[3])
    assert not kernels.splash_expressible(packed)


def test_resolve_impl_per_backend_and_length():
    assert resolve_impl("auto", 8192, 8192, backend="gpu") == "cudnn"
    assert resolve_impl("auto", 8192, 8192, backend="tpu") == "splash"
    assert resolve_impl("auto", 200, 256, backend="cpu") == "dense"
    assert resolve_impl("auto", 1024, 1024, backend="cpu") == "blockwise"
    from rag_jax.model import cpu_kernel    # a last block over cached passages: the fused kernel from 16 queries
    fused = cpu_kernel.available()
    assert resolve_impl("auto", 50, 3050, backend="cpu") == ("blockwise" if fused else "dense")
    assert resolve_impl("auto", 8, 3050, backend="cpu") == "dense"
    assert resolve_impl("auto", 129, 3050, backend="cpu") == "blockwise"
    assert resolve_impl("auto", 64, 4096, backend="cpu") == ("blockwise" if fused else "dense")
    assert resolve_impl("auto", 1, 1 << 21, backend="cpu") == "blockwise"
    assert resolve_impl("dense", 8192, 8192, backend="gpu") == "dense"
    with pytest.raises(ValueError, match="attention_impl='flash' is not supported; valid"):
        resolve_impl("flash", 1, 1)
    with pytest.raises(ValueError, match="ModelConfig.attention_impl='flash' is not supported"):
        ModelConfig.tiny(attention_impl="flash")


def test_whole_model_logits_dense_equals_blockwise(monkeypatch):
    monkeypatch.setattr(attention, "blockwise_attention", functools.partial(blockwise_attention, **CHUNKS))
    cfg = ModelConfig.tiny(attention_impl="dense", sliding_window=24)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(11)
    b, cache_len, L = 2, 20, 40
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (b, L)), jnp.int32)
    pos = jnp.asarray(np.tile(np.arange(cache_len, cache_len + L), (b, 1)), jnp.int32)
    seg = np.ones((b, L), np.int32)
    seg[1, 31:] = 0
    seg = jnp.asarray(seg)
    is_global = jnp.asarray(np.arange(L)[None].repeat(b, 0) >= 30)
    cache = KVSegment(k=jnp.asarray(rng.normal(size=(cfg.num_layers, b, cache_len, cfg.num_kv_heads, cfg.head_dim)),
                                    jnp.float32),
                      v=jnp.asarray(rng.normal(size=(cfg.num_layers, b, cache_len, cfg.num_kv_heads, cfg.head_dim)),
                                    jnp.float32),
                      positions=jnp.asarray(np.tile(np.arange(cache_len), (b, 1)), jnp.int32),
                      segment_ids=jnp.asarray(np.repeat([[2, 3]], 10, axis=1).repeat(b, 0), jnp.int32))
    valid = np.asarray(seg != 0)
    model.config = cfg.replace(attention_impl="blockwise")
    blockwise = jit_forward(model)
    model.config = cfg
    dense = jit_forward(model)
    for kwargs in (dict(mode="causal"), dict(mode="block", is_global=is_global, kv_cache=cache)):
        ref = dense(tokens, pos, seg, **kwargs).logits
        got = blockwise(tokens, pos, seg, **kwargs).logits
        np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(ref)[valid], atol=TOL, rtol=0)


def test_long_sequence_mlp_chunks_equal_a_float64_swiglu(monkeypatch):
    from rag_jax.model import transformer
    monkeypatch.setattr(transformer, "MLP_CHUNK", 16)  # 50 tokens: chunks of 16, 16, 16 and a ragged 2
    cfg = ModelConfig.tiny(mlp_bias=True)
    mlp = transformer.MLP(cfg, nnx.Rngs(3))
    rng = np.random.default_rng(5)
    for name in ("gate_bias", "up_bias", "down_bias"):  # biases start at zero: give them values
        getattr(mlp, name)[...] = jnp.asarray(rng.normal(size=getattr(mlp, name).shape), jnp.float32)
    x = rng.normal(size=(2, 50, cfg.hidden_size))
    w = {n: np.asarray(getattr(mlp, n)[...], np.float64) for n in ("gate", "up", "down", "gate_bias", "up_bias",
                                                                  "down_bias")}
    g, u = x @ w["gate"] + w["gate_bias"], x @ w["up"] + w["up_bias"]
    ref = (g / (1 + np.exp(-g)) * u) @ w["down"] + w["down_bias"]
    np.testing.assert_allclose(np.asarray(mlp(jnp.asarray(x, jnp.float32))), ref, atol=1e-5, rtol=1e-5)


def test_prefill_temporaries_do_not_grow_with_depth():
    """With the memory-optimized XLA:CPU scheduler (set by ``import rag_jax``) the layers' blockwise loops
    share buffers: 8 layers need about the temporaries of 2 (the default scheduler: +19 MB per layer at 8K)."""
    def temp_mb(num_layers):
        cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=num_layers,
                          num_heads=4, num_kv_heads=2, max_seq_len=4096, attention_impl="blockwise")
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))

        def fwd(state, tokens, positions, segment_ids):
            m = nnx.merge(graphdef, state)
            return m.logits(m(tokens, positions, segment_ids).hidden[:, -1:])
        t = jax.ShapeDtypeStruct((1, 4096), jnp.int32)
        return jax.jit(fwd).lower(state, t, t, t).compile().memory_analysis().temp_size_in_bytes / 2**20
    shallow, deep = temp_mb(2), temp_mb(8)
    assert deep < 1.25 * shallow, (shallow, deep)
