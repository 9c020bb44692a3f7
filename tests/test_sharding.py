"""Mesh + logical rules (rag_jax.sharding) and the sharded train step equal to the unsharded one (8 CPU devices)."""
import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rag_jax import sharding
from rag_jax.model import ModelConfig
from rag_jax.train import optim, step as step_lib
from rag_jax.train.objectives import LMLoss

MESHES = {"data=8": sharding.MeshConfig(data=8, fsdp=1, tensor=1),
          "fsdp=8": sharding.MeshConfig(data=1, fsdp=8, tensor=1),
          "data=2,fsdp=2,tensor=2": sharding.MeshConfig(data=2, fsdp=2, tensor=2)}


def test_mesh_fill_and_errors():
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=-1, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ValueError, match=r"has 12 devices but 8 are available"):
        sharding.make_mesh(sharding.MeshConfig(data=3, fsdp=2, tensor=2))
    with pytest.raises(ValueError, match=r"do not divide the 8 devices"):
        sharding.make_mesh(sharding.MeshConfig(data=3, fsdp=-1, tensor=1))
    with pytest.raises(ValueError, match="at most one mesh axis may be -1"):
        sharding.make_mesh(sharding.MeshConfig(data=-1, fsdp=-1))


def test_rules_drop_size_one_used_and_non_dividing_axes():
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
    to_spec = sharding.logical_to_spec
    assert to_spec(("embed", "heads", "head_dim"), mesh) == P("fsdp", "tensor", None)
    assert to_spec(("batch", "seq"), mesh) == P(("data", "fsdp"), None)
    # kv_heads=1 cannot be split over tensor=2: it stays replicated instead of failing
    assert to_spec(("embed", "kv_heads", "head_dim"), mesh, shape=(64, 1, 16)) == P("fsdp", None, None)
    # a mesh axis is used at most once per array: the second "embed" gets nothing
    assert to_spec(("embed", "embed"), mesh) == P("fsdp", None)
    # the same table on one device: every axis has size 1 and drops out
    one = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
    assert to_spec(("vocab", "embed"), one) == P(None, None)
    # rule order decides: with a fallback rule "embed" -> tensor after fsdp
    rules = sharding.DEFAULT_RULES + (("embed", ("tensor",)),)
    fsdp_only = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=1, tensor=8))
    assert to_spec(("embed", "mlp"), fsdp_only, rules) == P("tensor", None)
    with pytest.raises(ValueError, match="logical axis 'embd' has no sharding rule"):
        to_spec(("embd",), mesh)


def test_global_batch_must_divide_data_parallel_size():
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
    assert sharding.data_parallel_size(mesh) == 4
    sharding.check_global_batch(8, mesh)
    with pytest.raises(ValueError, match=r"global batch size 6 must be a positive multiple of the data-parallel "
                                         r"size 4"):
        sharding.check_global_batch(6, mesh)
    with pytest.raises(ValueError, match=r"grad_accum_steps 2 = 8"):
        sharding.check_global_batch(12, mesh, accum_steps=2)
    with pytest.raises(ValueError, match=r"global batch size 4 puts one row per data-parallel shard .* a multiple "
                                         r"of 8"):
        sharding.check_global_batch(4, mesh)
    sharding.check_global_batch(4, sharding.make_mesh(sharding.MeshConfig(data=4, fsdp=1, tensor=2)))  # one axis
    sharding.check_global_batch(8, sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=4, tensor=1)))  # no tensor


def test_xla_partitioner_bug_that_check_global_batch_guards_against():
    """The reproduction behind ``check_global_batch``'s one-row rule: ``x + (x @ w) @ w.T`` with ``x`` constrained
    to the residual stream's sharding on a 2 x 2 x 2 mesh is wrong in rows 1 and 2 with one row per batch shard
    and right with two. Fails once XLA computes it right: then the rule can go."""
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
    rng = np.random.default_rng()
    w = rng.standard_normal((32, 48)).astype(np.float32)

    def f(x, w):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")))
        return x + (x @ w) @ w.T
    step = jax.jit(f, in_shardings=(NamedSharding(mesh, P(("data", "fsdp"))), NamedSharding(mesh, P("fsdp", "tensor"))))
    errors = {}
    for rows in (4, 8):
        x = rng.standard_normal((rows, 16, 32)).astype(np.float32)
        want = x.astype(np.float64) + (x.astype(np.float64) @ w) @ w.T.astype(np.float64)
        errors[rows] = np.abs(np.asarray(step(x, w)) - want).reshape(rows, -1).max(1) / np.abs(want).max()
    assert (errors[8] < 1e-5).all() and (errors[4][[0, 3]] < 1e-5).all()
    assert (errors[4][[1, 2]] > 1e-2).all(), "XLA now partitions this right: drop check_global_batch's one-row rule"


CFG = ModelConfig.tiny(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                       num_kv_heads=2, max_seq_len=64)
LR = 1e-3


def _batch(seed=0, batch=8, seq=32):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (batch, seq)).astype(np.int32)
    # two packed documents per row with a padded tail, as the pipeline makes them
    cut = rng.integers(4, seq - 8, batch)
    pos = np.arange(seq)[None, :]
    segment_ids = np.where(pos < cut[:, None], 1, 2).astype(np.int32)
    segment_ids[:, -3:] = 0
    positions = np.where(segment_ids == 1, pos, pos - cut[:, None]).astype(np.int32) * (segment_ids > 0)
    return {"tokens": tokens, "positions": positions, "segment_ids": segment_ids}


def _one_step(mesh, tx, batch, init_state=None):
    """One train step on ``mesh``; the initial state is the reference one moved to this mesh's shardings
    (the same numbers, and one init compile for all meshes)."""
    graphdef, abstract, specs = step_lib.abstract_train_state(CFG, tx, seed=0)
    shardings = step_lib.train_state_shardings(abstract, specs, tx, mesh)
    if init_state is None:
        graphdef, init_state, shardings = step_lib.init_train_state(CFG, tx, mesh, seed=0)
    state = jax.device_put(init_state, shardings)
    train_step = step_lib.make_train_step(graphdef, tx, LMLoss(), shardings, mesh)
    bs = NamedSharding(mesh, sharding.logical_to_spec(("batch",), mesh))
    new_state, metrics = train_step(state, {k: jax.device_put(v, bs) for k, v in batch.items()})
    return new_state, metrics, shardings


@pytest.fixture(scope="module")
def reference():
    """The unsharded step on one device, with AdamW (our optimizer) and with plain SGD, and the initial
    states (copied to host, since the step donates its input)."""
    one = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
    batch = _batch()
    out = {"batch": batch}
    params = jax.device_get(step_lib.init_train_state(CFG, optax.sgd(0.5), one, seed=0)[1].params)
    for name, tx in (("sgd", optax.sgd(0.5)),
                     ("adamw", optim.make_optimizer(optim.OptimizerConfig(learning_rate=LR, warmup_steps=0), 10))):
        host_init = step_lib.TrainState(step=np.int32(0), params=params, opt_state=jax.device_get(tx.init(params)))
        out[name] = (tx, host_init, _one_step(one, tx, batch, host_init))
    return out


def _flat(tree):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def _check_step(mesh_name, mesh, tx, init_state, reference_state, reference_metrics, batch):
    state, metrics, shardings = _one_step(mesh, tx, batch, init_state)
    np.testing.assert_allclose(float(metrics["loss"]), float(reference_metrics["loss"]), rtol=1e-5)
    # outputs keep the declared shardings, and the params really are split across devices
    for leaf, want in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
    wq = state.params["layers"][0]["attn"]["wq"][...]
    assert (wq.addressable_shards[0].data.size < wq.size) == (mesh_name != "data=8")
    return state


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_step_equals_unsharded(reference, mesh_name):
    """SGD is linear in the gradient, so params after one step must agree at fp32 rounding (rtol 1e-5)."""
    tx, init, (ref_state, ref_metrics, _) = reference["sgd"]
    state = _check_step(mesh_name, sharding.make_mesh(MESHES[mesh_name]), tx, init, ref_state, ref_metrics,
                        reference["batch"])
    np.testing.assert_allclose(_flat(state.params), _flat(ref_state.params), rtol=1e-5, atol=1e-8)


def test_sharded_adamw_step_equals_unsharded(reference):
    """Our AdamW + clipping on the 3-axis mesh (optimizer moments sharded like their params)."""
    name = "data=2,fsdp=2,tensor=2"
    tx, init, (ref_state, ref_metrics, _) = reference["adamw"]
    state = _check_step(name, sharding.make_mesh(MESHES[name]), tx, init, ref_state, ref_metrics, reference["batch"])
    mu, ref_mu = (_flat(next(s.mu for s in jax.tree.leaves(st.opt_state, is_leaf=lambda x: hasattr(x, "mu"))
                             if hasattr(s, "mu"))) for st in (state, ref_state))
    # mu = (1 - b1) * g: the gradient itself; tolerance relative to the gradient scale (sums of
    # many terms cancel to near 0 in some entries, where elementwise rtol is meaningless)
    np.testing.assert_allclose(mu, ref_mu, rtol=1e-5, atol=1e-6 * np.abs(ref_mu).max())
    # Adam's first update is ~ lr * g / |g|: for gradients near 0 the rounding of g moves the update
    # by up to ~lr/200, so params get that absolute tolerance on top of rtol 1e-5.
    np.testing.assert_allclose(_flat(state.params), _flat(ref_state.params), rtol=1e-5, atol=LR / 200)
