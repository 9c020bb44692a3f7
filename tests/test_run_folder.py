"""Reading a run folder restores the parameters only: no optimizer is built, the trained weights come back."""
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from rag_jax.recipes.em_llm.passkey import train_model
from rag_jax.model import ModelConfig
from rag_jax.model.load import load_model
from rag_jax.model.run_folder import read_run_config, restore_params
from rag_jax.train import optim, step as step_lib

CFG = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                  max_seq_len=160)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder written by the trainer (2 steps, AdamW) and the trained model."""
    folder = tmp_path_factory.mktemp("runs") / "run"
    model = train_model(CFG, steps=2, batch=2, seq_len=160, lr=1e-2, seed=int(np.random.default_rng().integers(1000)),
                        run_dir=folder, progress=False)
    return folder, model


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def test_restored_params_equal_the_trained_ones(run):
    folder, model = run
    config = read_run_config(folder)
    step, graphdef, params = restore_params(folder / "checkpoints", config["model"])
    want = _leaves(nnx.state(model, nnx.Param))
    got = _leaves(params)
    assert step == 2 and len(got) == len(want) > 0
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(got, want))
    assert isinstance(nnx.merge(graphdef, params), type(model))
    with pytest.raises(FileNotFoundError, match="no complete checkpoint step 7"):
        restore_params(folder / "checkpoints", config["model"], step=7)


def test_the_loader_builds_no_optimizer(run, monkeypatch):
    folder, model = run

    def refuse(*args, **kwargs):
        raise AssertionError("loading a run folder built an optimizer / a train state")

    monkeypatch.setattr(optim, "make_optimizer", refuse)
    monkeypatch.setattr(step_lib, "abstract_train_state", refuse)
    loaded = load_model(folder)
    assert loaded.kind == "run" and loaded.eos_ids == () and loaded.tokenizer.encode("ab").ids == [97, 98]
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(nnx.state(loaded.model, nnx.Param)),
                                                    _leaves(nnx.state(model, nnx.Param))))
    # and in a fresh process, loading never imports the training package
    code = ("import sys; from rag_jax.model.load import load_model; load_model(sys.argv[1]); "
            "print(sorted(m for m in sys.modules if m.startswith(('rag_jax.train', 'rag_jax.data', "
            "'rag_jax.inference'))))")
    out = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=300,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": sys.path[0]})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("text, match", [
    ("model: [1, 2\n", "is not valid YAML"),
    ("- a list\n", "must hold a mapping of sections; got list"),
    ("model: {}\ntrain: {}\n", r"lacks the section\(s\) \['optimizer'\]"),
    ("model: {hidden_sise: 8}\noptimizer: {}\ntrain: {}\n", "hidden_sise"),
    ("model: {}\noptimizer: {}\ntrain: {precision: fp8}\n", "train.precision='fp8' is not valid"),
])
def test_a_malformed_config_is_one_line_naming_the_file(tmp_path, text, match):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "config.yaml").write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        read_run_config(tmp_path)
    assert str(tmp_path / "config.yaml") in str(e.value) and "\n" not in str(e.value)
