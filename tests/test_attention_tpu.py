"""Splash attention (rag_jax/model/kernels.py): the segment-id / causal-offset mapping equals the dense
reference through Pallas' interpreter on CPU (outputs and gradients), and ``attend(impl="splash")``
compiles ahead of time for a v5p chip (needs libtpu, no TPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax.model import kernels
from rag_jax.model.attention import attend
from rag_jax.model.masks import MaskSpec

TOL = 1e-5


def _arr(rng, *shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


def _block_spec_with_cache(rng, b, cache_len, q_len):
    """Block-Attention: cached passage blocks (one empty slot run), then a local block and a global suffix."""
    cache_seg = np.repeat(np.arange(1, 4), cache_len // 3)[None].repeat(b, 0).astype(np.int32)
    cache_seg[:, -rng.integers(3, 9):] = 0
    q_seg = np.full((b, q_len), 4, np.int32)
    q_seg[:, q_len // 2:] = 5
    q_seg[:, -5:] = 0
    is_global = np.arange(q_len)[None].repeat(b, 0) >= q_len // 2
    kv_seg = np.concatenate([cache_seg, q_seg], 1)
    return MaskSpec.create("block", q_seg, kv_seg, q_is_global=is_global)


def test_splash_interpreted_equals_dense():
    rng = np.random.default_rng(0)
    b, cache_len, q_len, heads, kv_heads, d = 1, 90, 70, 4, 2, 32
    spec = _block_spec_with_cache(rng, b, cache_len, q_len)
    q, k, v = _arr(rng, b, q_len, heads, d), _arr(rng, b, cache_len + q_len, kv_heads, d), \
        _arr(rng, b, cache_len + q_len, kv_heads, d)
    ct = _arr(rng, *q.shape) * jnp.asarray(spec.q_segment_ids != 0)[:, :, None, None]

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda q, k, v: (fn(q, k, v) * ct).sum(), argnums=(0, 1, 2)))
    splash = loss(lambda q, k, v: kernels.splash_attention(q, k, v, spec, interpret=True))
    dense = loss(lambda q, k, v: attend(q, k, v, spec, impl="dense"))
    (_, g_s), (_, g_d) = splash(q, k, v), dense(q, k, v)
    out = kernels.splash_attention(q, k, v, spec, interpret=True)
    np.testing.assert_allclose(out, attend(q, k, v, spec, impl="dense"), atol=TOL, rtol=0)
    for a, b_ in zip(g_s, g_d):
        assert float(jnp.abs(b_).max()) > 1e-3
        np.testing.assert_allclose(a, b_, atol=TOL, rtol=0)


@pytest.fixture
def _compile_only_libtpu(monkeypatch):
    pytest.importorskip("libtpu", reason='TPU AOT compile needs libtpu: pip install -e ".[tpu]" (no TPU needed)')
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-8")
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def test_splash_block_attention_compiles_for_v5p(_compile_only_libtpu):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rag_jax.train import aot
    _, devices = aot.topology_devices("v5p:2x2x1")
    sharding = NamedSharding(Mesh(np.array(devices[:1]), ("data",)), PartitionSpec())
    b, cache_len, q_len, heads, kv_heads, d = 2, 512, 512, 8, 2, 128

    def abstract(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def grads(q, k, v, q_seg, kv_seg, is_global):
        spec = MaskSpec.create("block", q_seg, kv_seg, q_is_global=is_global)
        return jax.grad(lambda q, k, v: attend(q, k, v, spec, impl="splash").astype(jnp.float32).sum(),
                        argnums=(0, 1, 2))(q, k, v)

    args = (abstract((b, q_len, heads, d), jnp.bfloat16), abstract((b, cache_len + q_len, kv_heads, d), jnp.bfloat16),
            abstract((b, cache_len + q_len, kv_heads, d), jnp.bfloat16), abstract((b, q_len), jnp.int32),
            abstract((b, cache_len + q_len), jnp.int32), abstract((b, q_len), jnp.bool_))
    compiled = jax.jit(grads).lower(*args).compile()
    text = compiled.as_text()
    # forward: local + global kernel calls; backward: dq and dkv kernels for each
    assert text.count("tpu_custom_call") >= 4
    assert compiled.memory_analysis().temp_size_in_bytes > 0


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_partitioned_kernel_call_equals_one_call_on_the_whole_arrays(kv_heads):
    """``kernels.partitioned`` inside a data 2 x fsdp 2 x tensor 2 mesh: rows split 4 ways and heads 2 ways (or
    heads kept whole where the KV heads do not divide) give the unsplit result, outputs and gradients."""
    from rag_jax import sharding
    from rag_jax.model.blockwise import blockwise_attention

    rng = np.random.default_rng()
    b, cache_len, q_len, heads, d = 4, 48, 40, 4, 16
    spec = _block_spec_with_cache(rng, b, cache_len, q_len)
    q, k, v = _arr(rng, b, q_len, heads, d), _arr(rng, b, cache_len + q_len, kv_heads, d), \
        _arr(rng, b, cache_len + q_len, kv_heads, d)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
    seen = []

    def kernel(q, k, v, spec):
        seen.append((q.shape, k.shape, spec.q_segment_ids.shape))
        return blockwise_attention(q, k, v, spec)[0]

    def loss(q, k, v):
        return (kernels.partitioned(kernel)(q, k, v, spec) ** 2).sum()
    with sharding.activation_rules(mesh):
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    split_heads = heads // 2 if kv_heads == 2 else heads
    assert seen[0] == ((1, q_len, split_heads, d), (1, cache_len + q_len, kv_heads // (2 if kv_heads == 2 else 1), d),
                       (1, q_len))
    want, want_grads = jax.value_and_grad(lambda q, k, v: (attend(q, k, v, spec, impl="dense") ** 2).sum(),
                                          argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    for a, b_ in zip(grads, want_grads):   # gradients of a sum of squares reach ~20: fp32 reordering is relative
        np.testing.assert_allclose(a, b_, atol=TOL, rtol=1e-5)


def test_sharded_train_step_with_splash_has_no_qkv_all_gather(_compile_only_libtpu):
    """The train step with splash attention on v5p-8 (fsdp 2 x tensor 2) compiles (a Mosaic call outside
    shard_map cannot be partitioned at all), calls the kernel per shard, and no all-gather in the compiled
    program produces a q/k/v-shaped array ``[rows, seq, heads, head_dim]``."""
    import re

    from rag_jax import sharding
    from rag_jax.train import aot
    from rag_jax.train.trainer import load_run_config

    seq, head_dim = 512, 128
    cfg = load_run_config(None, [
        "model.hidden_size=256", "model.num_heads=4", "model.num_kv_heads=2", f"model.head_dim={head_dim}",
        "model.intermediate_size=512", "model.num_layers=2", "model.vocab_size=1024", f"model.max_seq_len={seq}",
        "model.attention_impl=splash", "model.dtype=bfloat16", f"data.seq_len={seq}", "train.global_batch_size=4",
        "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "train.objective=lm_causal"])
    _, devices = aot.topology_devices("v5p-8")
    text = aot.compile_train_step(cfg, sharding.make_mesh(cfg.mesh, devices)).as_text()
    assert text.count("tpu_custom_call") >= 4    # forward and backward kernels of both layers
    gathered = re.findall(r"= \w+\[([\d,]+)\][^ ]* all-gather(?:-start)?\(", text)
    assert gathered                               # FSDP weight gathers are there ...
    shapes = [tuple(map(int, s.split(","))) for s in gathered]
    assert not [s for s in shapes if len(s) == 4 and seq in s and s[-1] == head_dim]   # ... but no q/k/v
