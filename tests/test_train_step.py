"""The train step's options: gradient accumulation, remat, precision, LR schedule, donation."""
import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from rag_jax import sharding
from rag_jax.model import ModelConfig
from rag_jax.model.config import apply_precision
from rag_jax.train import optim, step as step_lib
from rag_jax.train.objectives import LMLoss

CFG = ModelConfig.tiny(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, max_seq_len=64)
MESH_CFG = sharding.MeshConfig(data=2, fsdp=4)


def _batch(seed=0, batch=8, seq=24):
    """Rows with different numbers of target tokens, so micro-batches carry unequal weights."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (batch, seq)).astype(np.int32)
    lengths = rng.integers(3, seq + 1, batch)
    segment_ids = (np.arange(seq)[None] < lengths[:, None]).astype(np.int32)
    positions = np.tile(np.arange(seq, dtype=np.int32), (batch, 1)) * segment_ids
    return {"tokens": tokens, "positions": positions, "segment_ids": segment_ids}


def _step(tx, init, *, accum=1, remat="none", precision="fp32", steps=1):
    """``steps`` train steps from the host state ``init`` (one init compile shared by all tests).

    Also checks that the step donates its input state (the old buffers are freed)."""
    mesh = sharding.make_mesh(MESH_CFG)
    cfg = apply_precision(CFG, precision)
    graphdef, abstract, specs = step_lib.abstract_train_state(cfg, tx, seed=0, remat_policy=remat)
    shardings = step_lib.train_state_shardings(abstract, specs, tx, mesh)
    state = jax.device_put(init, shardings)
    train_step = step_lib.make_train_step(graphdef, tx, LMLoss(), shardings, mesh, accum_steps=accum)
    bs = NamedSharding(mesh, sharding.logical_to_spec(("batch",), mesh))
    metrics = []
    for i in range(steps):
        old_leaf = jax.tree.leaves(state.params)[0]
        state, m = train_step(state, {k: jax.device_put(v, bs) for k, v in _batch(i).items()})
        assert old_leaf.is_deleted() and int(state.step) == i + 1
        metrics.append(jax.device_get(m))
    return state, metrics


@pytest.fixture(scope="module")
def params():
    _, state, _ = step_lib.init_train_state(CFG, optax.sgd(0.5), sharding.make_mesh(MESH_CFG), seed=0)
    return jax.device_get(state.params)


def _init(tx, params):
    return step_lib.TrainState(step=np.int32(0), params=params, opt_state=jax.device_get(tx.init(params)))


@pytest.fixture(scope="module")
def sgd_reference(params):
    tx = optax.sgd(0.5)
    init = _init(tx, params)
    state, metrics = _step(tx, init, steps=2)
    return tx, init, state, metrics


def _params(state):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(state.params)])


def test_grad_accumulation_equals_full_batch(sgd_reference):
    """Micro-batch gradients weighted by their target-token counts = the full-batch token-mean gradient."""
    tx, init, ref_state, ref_metrics = sgd_reference
    state, metrics = _step(tx, init, accum=2, steps=2)
    np.testing.assert_allclose(_params(state), _params(ref_state), rtol=1e-5, atol=1e-7)
    for m, r in zip(metrics, ref_metrics):
        np.testing.assert_allclose(m["loss"], r["loss"], rtol=1e-5)
        assert m["num_tokens"] == r["num_tokens"]


def test_remat_does_not_change_the_step(sgd_reference):
    tx, init, ref_state, _ = sgd_reference
    state, _ = _step(tx, init, remat="full", steps=2)
    np.testing.assert_allclose(_params(state), _params(ref_state), rtol=1e-5, atol=1e-7)


def test_bf16_compute_keeps_fp32_master_params(sgd_reference, params):
    tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3, warmup_steps=0), 10)
    state, metrics = _step(tx, _init(tx, params), precision="bf16")
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(state.opt_state) if x.ndim} == {np.dtype("float32")}
    _, _, _, ref_metrics = sgd_reference
    # same init and batch as the fp32 reference: bf16 logits differ only by rounding
    np.testing.assert_allclose(metrics[0]["loss"], ref_metrics[0]["loss"], rtol=2e-2)
    with pytest.raises(ValueError, match="precision='fp16'"):
        apply_precision(CFG, "fp16")


def test_learning_rate_schedule():
    cfg = optim.OptimizerConfig(learning_rate=1.0, warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    lr = optim.learning_rate_schedule(cfg, 110)
    np.testing.assert_allclose([float(lr(s)) for s in (0, 5, 10)], [0.0, 0.5, 1.0], atol=1e-6)
    for s in (10, 35, 60, 110):  # cosine from 1.0 at step 10 to 0.1 at step 110
        want = 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * (s - 10) / 100))
        np.testing.assert_allclose(float(lr(s)), want, rtol=1e-5)
    linear = optim.learning_rate_schedule(optim.OptimizerConfig(learning_rate=2.0, warmup_steps=0, decay="linear",
                                                                min_lr_ratio=0.0), 100)
    np.testing.assert_allclose([float(linear(s)) for s in (0, 50, 100)], [2.0, 1.0, 0.0], atol=1e-6)
    with pytest.raises(ValueError, match="min_lr_ratio=2"):
        optim.OptimizerConfig(min_lr_ratio=2)


def test_clipping_bounds_the_update():
    cfg = optim.OptimizerConfig(learning_rate=1.0, warmup_steps=0, decay="constant", weight_decay=0.0,
                                grad_clip_norm=0.5, b1=0.0, b2=0.0, eps=0.0)
    tx = optim.make_optimizer(cfg, 10)
    grads = {"w": np.full((4, 4), 3.0, np.float32), "b": np.full((4,), -3.0, np.float32)}
    params = {k: np.zeros_like(v) for k, v in grads.items()}
    clipped = optax.clip_by_global_norm(0.5).update(grads, None)[0]
    assert np.isclose(float(optax.tree.norm(clipped)), 0.5)
    # with b1 = b2 = 0 Adam's update is g / |g| = sign(g): the clipped gradient keeps its direction
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -1.0)
    np.testing.assert_allclose(updates["b"], 1.0)


def test_init_train_state_from_given_params(params):
    """``params=`` starts from a given model (e.g. a pretrained base) in the train state's shardings, fresh
    optimizer state; bf16 params are cast to the state's float32 master weights."""
    mesh = sharding.make_mesh(MESH_CFG)
    rng = np.random.default_rng(4)
    given = jax.tree.map(lambda p: (np.asarray(p) + rng.normal(size=p.shape)).astype(np.float32), params)
    tx = optax.adam(1e-3)
    _, state, shardings = step_lib.init_train_state(CFG, tx, mesh, seed=0, params=given)
    for got, want, shard in zip(jax.tree.leaves(state.params), jax.tree.leaves(given),
                                jax.tree.leaves(shardings.params)):
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.sharding == shard
    assert int(state.step) == 0 and all(float(np.abs(np.asarray(m)).max()) == 0.0
                                        for m in jax.tree.leaves(state.opt_state) if np.ndim(m) > 0)
    half = jax.tree.map(lambda p: np.asarray(p).astype(jax.numpy.bfloat16), given)
    _, state, _ = step_lib.init_train_state(CFG, tx, mesh, seed=0, params=half)
    leaf = jax.tree.leaves(state.params)[0]
    assert leaf.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(leaf), np.asarray(jax.tree.leaves(half)[0]).astype(np.float32))


def test_cpu_train_step_fuses_only_dots_into_xnnpack(monkeypatch):
    """On CPU the step compiles with ``CPU_TRAIN_COMPILER_OPTIONS``: every XNNPACK fusion holds a dot, where the
    same step without the option also has elementwise-only ones."""
    import re
    from rag_jax.benchmarks.train_bench import lm_rows
    tx, mesh = optax.sgd(0.5), sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
    graphdef, state, shardings = step_lib.init_train_state(CFG, tx, mesh, seed=0)
    batch = lm_rows(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 24)).astype(np.int32), mesh)
    assert step_lib.compiler_options(mesh) == step_lib.CPU_TRAIN_COMPILER_OPTIONS

    def ynn_bodies():
        text = step_lib.make_train_step(graphdef, tx, LMLoss(), shardings, mesh).lower(state, batch).compile().as_text()
        calls = re.findall(r"calls=%([\w.\-]+), .*__ynn_fusion", text)
        return [text.split(f"%{c} (", 1)[1].split("\n}\n", 1)[0] for c in calls]
    bodies = ynn_bodies()
    assert bodies and all(" dot(" in b for b in bodies)
    monkeypatch.setattr(step_lib, "compiler_options", lambda mesh: None)
    assert any(" dot(" not in b for b in ynn_bodies())
