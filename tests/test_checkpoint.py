"""Orbax checkpoints (rag_jax/train/checkpoint.py): sharded round trip, iterator state, keep-K, damaged steps."""
import logging
import os

import grain
import jax
import numpy as np
import pytest

from rag_jax import sharding
from rag_jax.model import ModelConfig
from rag_jax.train import checkpoint as ckpt_lib
from rag_jax.train import optim, step as step_lib

CFG = ModelConfig.tiny(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, max_seq_len=64)
TX = optim.make_optimizer(optim.OptimizerConfig(), 10)


@pytest.fixture(scope="module")
def state_and_mesh():
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=8))
    _, state, shardings = step_lib.init_train_state(CFG, TX, mesh, seed=1)
    # distinct values in every leaf, so a mix-up of leaves cannot go unnoticed
    state = jax.tree.map(lambda x, s: jax.device_put(np.asarray(x) + np.arange(x.size).reshape(x.shape) * 1e-3
                                                     if x.ndim else x, s), state, shardings)
    return state, shardings, mesh


def _iterator():
    return iter(grain.MapDataset.range(1000).seed(0).shuffle().batch(4).to_iter_dataset())


def _target(mesh):
    _, abstract, specs = step_lib.abstract_train_state(CFG, TX, seed=1)
    return ckpt_lib.abstract_with_shardings(abstract, step_lib.train_state_shardings(abstract, specs, TX, mesh))


def _assert_equal_trees(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_onto_another_mesh_with_iterator_state(tmp_path, state_and_mesh):
    state, _, _ = state_and_mesh
    ckpt = ckpt_lib.Checkpointer(ckpt_lib.CheckpointConfig(dir=str(tmp_path), save_every=2, keep=2))
    it = _iterator()
    saved_batches = {}
    for step in range(1, 7):
        next(it)
        if ckpt.save(step, state, it):
            saved_batches[step] = next(_clone(it))
    ckpt.close()
    assert sorted(saved_batches) == [2, 4, 6]
    assert ckpt_lib.Checkpointer(ckpt.cfg).all_steps() == [4, 6]  # keep=2

    other_mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
    restored_it = _iterator()
    step, restored = ckpt_lib.Checkpointer(ckpt.cfg).restore_latest(_target(other_mesh), restored_it)
    assert step == 6
    _assert_equal_trees(restored, state)
    wq = restored.params["layers"][0]["attn"]["wq"][...]
    assert wq.sharding.spec == sharding.logical_to_spec(("embed", "heads", "head_dim"), other_mesh)
    np.testing.assert_array_equal(next(restored_it), saved_batches[6])


def _clone(it):
    twin = _iterator()
    twin.set_state(it.get_state())
    return twin


def _save_steps(path, state, steps):
    ckpt = ckpt_lib.Checkpointer(ckpt_lib.CheckpointConfig(dir=str(path), save_every=1, keep=5))
    for s in steps:
        ckpt.save(s, state)
    ckpt.close()
    return ckpt.cfg


def _damage_array_data(step_dir):
    """Truncate the tensor data files (not the metadata) of one saved step."""
    n = 0
    for root, _, files in os.walk(step_dir / "state"):
        if os.path.basename(root) == "d" and "ocdbt" in root:
            for f in files:
                with open(os.path.join(root, f), "r+b") as fh:
                    fh.truncate(16)
                n += 1
    assert n > 0


def test_damaged_latest_step_falls_back_with_a_log_line(tmp_path, state_and_mesh, caplog):
    state, _, mesh = state_and_mesh
    cfg = _save_steps(tmp_path, state, [1, 2])
    _damage_array_data(tmp_path / "2")
    # an interrupted save leaves only a temporary folder, which is never listed
    (tmp_path / "3.orbax-checkpoint-tmp-1234").mkdir()
    ckpt = ckpt_lib.Checkpointer(cfg)
    assert ckpt.all_steps() == [1, 2]
    with caplog.at_level(logging.WARNING, logger="rag_jax.train.checkpoint"):
        step, restored = ckpt.restore_latest(_target(mesh))
    assert step == 1
    _assert_equal_trees(restored, state)
    assert "checkpoint step 2" in caplog.text and "unreadable" in caplog.text
    assert "restored checkpoint step 1 after skipping unreadable steps [2]" in caplog.text


def test_all_steps_damaged_is_a_clear_error(tmp_path, state_and_mesh):
    state, _, mesh = state_and_mesh
    cfg = _save_steps(tmp_path, state, [1])
    _damage_array_data(tmp_path / "1")
    with pytest.raises(RuntimeError, match=r"(?s)no readable checkpoint in .*step 1:"):
        ckpt_lib.Checkpointer(cfg).restore_latest(_target(mesh))
    assert ckpt_lib.Checkpointer(ckpt_lib.CheckpointConfig(dir=str(tmp_path / "empty"))).restore_latest(
        _target(mesh)) is None
