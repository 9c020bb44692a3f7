"""What a new user hit on a fresh install (issue 27): sampling flags validated before a model loads, no libtpu start on
a machine without accelerators, progress bars only on a terminal, no stray bm25s DEBUG line, config keys given
without their section and missing model files named as such. Each test fails on the code before issue 27."""
import io
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rag_jax import cli
from rag_jax.model import load as load_mod

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv,flag", [
    (["chat", "--temperature", "-1", "hi"], "--temperature"),
    (["chat", "--temperature", "nan", "hi"], "--temperature"),
    (["chat", "--max-new-tokens", "0", "hi"], "--max-new-tokens"),
    (["generate", "--max-new-tokens", "-2", "x"], "--max-new-tokens"),
    (["chat", "--top-k", "0", "hi"], "--top-k"),
    (["chat", "--top-p", "0", "hi"], "--top-p"),
    (["generate", "--top-p", "1.01", "x"], "--top-p"),
])
def test_bad_sampling_flags_are_one_line_errors_before_the_model_loads(argv, flag, monkeypatch, capsys):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")
    monkeypatch.setattr(load_mod, "load_model", no_load)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.count("\n") == 0 and flag in err and "error:" in err, err


def _has_accelerator() -> bool:
    from jax._src import hardware_utils
    return (hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0 or hardware_utils.has_visible_nvidia_gpu()
            or hardware_utils.num_available_amd_gpus(stop_at=1) > 0)


def test_no_libtpu_start_without_an_accelerator():
    """``import rag_jax`` with no JAX_PLATFORMS on a CPU machine: JAX does not load libtpu (whose start prints
    "could not determine TPU accelerator type" errors), and ``rag-jax smoke`` writes nothing to stderr."""
    if _has_accelerator():
        pytest.skip("this machine has an accelerator; JAX's platform choice is left alone there")
    pytest.importorskip("libtpu")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = str(ROOT)
    probe = ("import rag_jax, jax; jax.devices(); from jax._src.lib import _jax; "
             "print(jax.default_backend(), _jax.pjrt_plugin_loaded('tpu'))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["cpu", "False"], out.stdout + out.stderr
    smoke = subprocess.run([sys.executable, "-m", "rag_jax", "smoke"], env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert smoke.returncode == 0 and "smoke run ok" in smoke.stdout
    assert smoke.stderr == "", smoke.stderr


class _Embedder:
    dim = 4

    def embed(self, texts):
        return np.random.default_rng().standard_normal((len(texts), self.dim))


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bars_only_on_a_terminal(monkeypatch):
    from rag_jax.retrieval.embedders import embed_texts

    log = io.StringIO()                                       # a log file or pipe: not a terminal
    monkeypatch.setattr(sys, "stderr", log)
    embed_texts(_Embedder(), ["a", "b", "c"], chunk_size=1, progress=True)
    assert log.getvalue() == ""                               # carriage-return updates before issue 27
    from rag_jax.progress import progress_bar
    tty = _Terminal()
    for _ in progress_bar(range(3), file=tty, desc="x"):
        pass
    assert "\r" in tty.getvalue() and "3/3" in tty.getvalue()
    off = _Terminal()
    for _ in progress_bar(range(3), enabled=False, file=off):
        pass
    assert off.getvalue() == ""


def test_progress_in_a_log_is_a_line_a_minute(monkeypatch):
    """A long bar written to a log (not a terminal): whole lines, no carriage returns, one per interval and one
    at the end; a bar shorter than the interval writes nothing (above)."""
    from rag_jax import progress
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.05)
    log = io.StringIO()
    n = int(np.random.default_rng().integers(3, 6))
    for _ in progress.progress_bar(range(n), file=log, desc="rows"):
        time.sleep(0.08)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and 2 <= len(lines) <= n + 1
    assert lines[-1].startswith("rows: 100%") and f"{n}/{n}" in lines[-1]
    assert len(set(lines)) == len(lines)                      # a refresh with nothing new is not repeated


def test_bm25_writes_no_debug_line_to_the_applications_log():
    from rag_jax.retrieval.lexical import BM25Index

    records = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = records.append
    logging.getLogger().addHandler(handler)
    try:
        BM25Index(["alpha beta", "gamma delta"]).search(["beta"], 1)
    finally:
        logging.getLogger().removeHandler(handler)
    assert [r.getMessage() for r in records if r.name.startswith("bm25s") and r.levelno < logging.WARNING] == []


def test_config_key_without_its_section_suggests_the_dotted_key():
    from rag_jax import config as config_lib
    from rag_jax.recipes.rag_demo.config import DemoConfig

    with pytest.raises(config_lib.ConfigError, match=r"did you mean 'model\.hidden_size'\?"):
        config_lib.load_config(DemoConfig, None, ["hidden_size=64"])
    with pytest.raises(config_lib.ConfigError, match=r"did you mean 'model\.hidden_size'\?"):
        config_lib.load_config(DemoConfig, None, ["model.hiden_size=64"])


def test_missing_model_file_is_reported_as_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model path '.*nope\.gguf': not found; pass an embedded model name"):
        load_mod.resolve_model(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="has neither config.json"):
        load_mod.resolve_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="not an embedded model name"):
        load_mod.resolve_model("no-such-model")


def test_tfds_build_writes_no_progress_bars_to_a_log(tmp_path, capfd):
    """Building the PhantomWiki tfds dataset with stderr going to a file or pipe (not a terminal): tfds' own
    progress bars stay off (carriage-return updates in the kill campaign's log before issue 27)."""
    pytest.importorskip("tensorflow_datasets")
    from rag_jax.data.phantom_tfds import PhantomWikiConfig, prepare

    seed = int(np.random.default_rng().integers(1000))
    cfg = PhantomWikiConfig(name=f"articles_p30_s{seed}", kind="articles", num_people=30, seed=seed, num_questions=0)
    prepare(tmp_path, cfg)
    err = capfd.readouterr().err
    assert "\r" not in err and "examples/s" not in err, err[-300:]
