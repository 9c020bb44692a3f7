"""Multi-process training on loopback and bit-exact resume after SIGKILL (subprocesses of `python -m train.train`).

Runs (each a real JAX job; a shared persistent compilation cache keeps the repeats cheap):
  ref:     1 process x 4 CPU devices, 20 steps, checkpoints every 5.
  multi:   2 processes x 2 CPU devices (gloo), 5 steps, same data order (data.num_shards=2).
  killed:  as ref, but the process SIGKILLs itself right after starting the async save of step 10.
  resumed: the killed run's command again: restores the newest complete checkpoint and runs to 20.
"""
import concurrent.futures
import os
import re
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from rag_jax import distributed, sharding
from rag_jax.data import pipeline
from rag_jax.data.text_tfds import prepare_text_dataset
from rag_jax.model.config import apply_precision
from rag_jax.train import checkpoint as ckpt_lib
from rag_jax.train import metrics as metrics_lib
from rag_jax.train import optim, step as step_lib
from rag_jax.train import trainer

ROOT = Path(__file__).resolve().parents[1]
KILL_AT = 10
KILL_DRIVER = f"""
import os, signal, sys
from rag_jax.train import checkpoint
_save = checkpoint.Checkpointer.save
def save(self, step, *args, **kwargs):
    started = _save(self, step, *args, **kwargs)
    if step == {KILL_AT}:
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, the async write of step {KILL_AT} is cut off
    return started
checkpoint.Checkpointer.save = save
from train.train import main
main(sys.argv[1:])
"""


def _overrides(data_dir, out, steps=20):
    return [f"data.data_dir={data_dir}", f"train.run_dir={out}/run", f"checkpoint.dir={out}/ckpt",
            f"train.steps={steps}", "train.log_every=1", "train.global_batch_size=8", "model.num_layers=1",
            "data.seq_len=64", "data.num_shards=2", "data.eval_batches=0", "optimizer.decay=constant",
            "optimizer.warmup_steps=2", "checkpoint.save_every=5", "checkpoint.keep=3",
            "logging.tensorboard=false", "logging.progress_bar=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    data_dir = tmp / "tfds"
    prepare_text_dataset("phantom_wiki/articles_p60_s0", data_dir, 512)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "JAX_COMPILATION_CACHE_DIR": str(tmp / "jax_cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    config = str(ROOT / "train" / "configs" / "tiny.yaml")

    def launch(name, procs, devices, steps=20, driver=("-m", "train.train")):
        argv = [sys.executable, *driver, "--config", config, *_overrides(data_dir, tmp / name, steps)]
        return distributed.launch_local(argv, procs, devices, timeout_s=300, env=env)

    launch("ref", 1, 4)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        multi = pool.submit(launch, "multi", 2, 2, 5)
        killed = pool.submit(launch, "killed", 1, 4, 20, ("-c", KILL_DRIVER))
        with pytest.raises(RuntimeError, match=r"rc=-9"):
            killed.result()
        multi.result()
    killed_steps = sorted(int(p.name) for p in (tmp / "killed" / "ckpt").iterdir() if p.name.isdigit())
    resumed = launch("killed", 1, 4)[0]
    return {"tmp": tmp, "data_dir": data_dir, "killed_steps": killed_steps, "resumed_log": resumed.stderr}


def _losses(path):
    return {r["step"]: r["train/loss"] for r in metrics_lib.read_jsonl(path) if "train/loss" in r}


def test_two_processes_match_one_process(runs):
    ref = _losses(runs["tmp"] / "ref" / "run" / "metrics.jsonl")
    multi = _losses(runs["tmp"] / "multi" / "run" / "metrics.jsonl")
    assert sorted(multi) == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([multi[s] for s in range(1, 6)], [ref[s] for s in range(1, 6)], rtol=1e-5)
    assert ref[5] < ref[1]  # it trains
    # both processes wrote their part of the checkpoint (orbax multi-host save of the final step)
    assert (runs["tmp"] / "multi" / "ckpt" / "5").is_dir()


def _restore(run_dir, data_dir, step):
    cfg = trainer.load_run_config(ROOT / "train" / "configs" / "tiny.yaml", _overrides(data_dir, run_dir))
    mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
    tx = optim.make_optimizer(cfg.optimizer, cfg.train.steps)
    _, abstract, specs = step_lib.abstract_train_state(apply_precision(cfg.model, "fp32"), tx)
    target = ckpt_lib.abstract_with_shardings(abstract, step_lib.train_state_shardings(abstract, specs, tx, mesh))
    data_iter = iter(pipeline.make_lm_dataset(cfg.data, split="train", global_batch=8,
                                              tokenizer_path=pipeline.check_dataset(cfg.data, 512)))
    state = ckpt_lib.Checkpointer(cfg.checkpoint).restore(step, target, data_iter)
    return state, next(data_iter)


def test_resume_after_sigkill_is_bit_identical(runs):
    tmp = runs["tmp"]
    # the kill came right after step 10's save started: step 5 is complete, step 10 only if its write won
    assert runs["killed_steps"] in ([5], [5, 10]), runs["killed_steps"]
    resumed_from = int(re.search(r"resumed from checkpoint step (\d+)", runs["resumed_log"]).group(1))
    assert resumed_from == runs["killed_steps"][-1]

    ref_state, ref_next = _restore(tmp / "ref", runs["data_dir"], 20)
    state, next_batch = _restore(tmp / "killed", runs["data_dir"], 20)
    assert int(state.step) == int(ref_state.step) == 20
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for k in ref_next:
        np.testing.assert_array_equal(next_batch[k], ref_next[k])
    ref, resumed = (_losses(tmp / n / "run" / "metrics.jsonl") for n in ("ref", "killed"))
    assert all(resumed[s] == ref[s] for s in range(resumed_from + 1, 21))
