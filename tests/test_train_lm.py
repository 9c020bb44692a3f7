"""End-to-end LM training on the project's text (PhantomWiki articles via tfds + grain) and early input errors."""
import json
from pathlib import Path

import pytest

from rag_jax.data.text_tfds import prepare_text_dataset
from rag_jax.model.config import apply_precision
from rag_jax.train import metrics as metrics_lib
from rag_jax.train import step as step_lib
from rag_jax.train import trainer

CONFIGS = Path(__file__).resolve().parents[1] / "train" / "configs"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tfds")
    prepare_text_dataset("phantom_wiki/articles_p60_s0", path, 512)
    return path


def test_training_reduces_held_out_loss(data_dir, tmp_path):
    cfg = trainer.load_run_config(CONFIGS / "tiny.yaml", [
        f"data.data_dir={data_dir}", f"train.run_dir={tmp_path / 'run'}", "train.steps=30", "train.eval_every=30",
        "model.num_layers=1", "data.seq_len=128", "data.eval_batches=2", "logging.peak_flops_per_device=1e12",
        "mesh.data=2", "mesh.fsdp=-1", "train.grad_accum_steps=2", "train.global_batch_size=16",
        "logging.progress_bar=false"])
    result = trainer.run(cfg)
    (step0, first), (step30, last) = result["eval"]
    assert (step0, step30) == (0, 30) and result["step"] == 30
    # random init is ~ln(512) = 6.2 nats/token; 30 steps on 54 articles must learn the templates
    assert first["loss"] > 5.5
    assert last["loss"] < first["loss"] - 1.5, (first, last)
    assert last["num_tokens"] == first["num_tokens"] > 0  # the same held-out tokens both times

    rows = metrics_lib.read_jsonl(tmp_path / "run" / "metrics.jsonl")
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [5, 10, 15, 20, 25, 30]
    assert train_rows[-1]["train/loss"] < train_rows[0]["train/loss"]
    want_flops = metrics_lib.train_flops_per_token(apply_precision(cfg.model, "fp32"), 128)
    for r in train_rows:
        assert r["train/flops_per_token"] == want_flops
        assert r["train/tokens_per_s"] > 0 and r["train/step_time_s"] > 0
        assert r["train/mfu"] == pytest.approx(r["train/tokens_per_s"] * want_flops / (8 * 1e12))
    assert [r["step"] for r in rows if "eval/loss" in r] == [0, 30]
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert json.dumps(rows)  # plain JSON values only


def test_flops_per_token_formula():
    from rag_jax.model import ModelConfig
    cfg = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1)
    # per layer: q 8*8 + k 8*4 + v 8*4 + o 8*8 = 192, mlp 3*8*16 = 384; head 8*100
    assert metrics_lib.matmul_params(cfg) == 2 * (192 + 384) + 800
    assert metrics_lib.train_flops_per_token(cfg, 10) == 6 * 1952 + 6 * 2 * 10 * 2 * 4
    assert metrics_lib.train_flops_per_token(cfg, 10, causal=False) == 6 * 1952 + 12 * 2 * 10 * 2 * 4
    assert metrics_lib.mfu(100.0, 1e9, 2, 1e11) == pytest.approx(0.5)
    assert metrics_lib.mfu(100.0, 1e9, 2, None) is None


@pytest.fixture
def no_compile(monkeypatch):
    """Fail the test if anything reaches parameter init / step building (errors must come first)."""
    def boom(*a, **k):
        raise AssertionError("compiled before validating the input")
    monkeypatch.setattr(step_lib, "init_train_state", boom)
    monkeypatch.setattr(step_lib, "make_train_step", boom)


@pytest.mark.parametrize("overrides, error, match", [
    (["mesh.data=3", "mesh.fsdp=2"], ValueError, r"mesh .* has 6 devices but 8 are available"),
    (["train.global_batch_size=12"], ValueError, r"global batch size 12 must be a positive multiple of the "
                                                 r"data-parallel size 8"),
    (["data.data_dir=/nonexistent/tfds"], FileNotFoundError, r"dataset directory /nonexistent/tfds/phantom_wiki/"
                                                             r"articles_p60_s0/1.0.0 does not exist"),
    (["model.vocab_size=300", "data.tokenizer={data_dir}/tokenizers/phantom_wiki_articles_p60_s0_bpe512.json"],
     ValueError, r"tokenizer .* has 512 tokens but model.vocab_size=300"),
])
def test_bad_input_fails_before_compiling(data_dir, no_compile, overrides, error, match):
    overrides = [o.format(data_dir=data_dir) for o in overrides]
    if not any(o.startswith("data.data_dir=") for o in overrides):
        overrides = [f"data.data_dir={data_dir}", *overrides]
    cfg = trainer.load_run_config(CONFIGS / "tiny.yaml", overrides)
    with pytest.raises(error, match=match):
        trainer.run(cfg)


def test_bad_config_key_fails_before_anything():
    with pytest.raises(ValueError, match=r"unknown config key 'train.global_batch'"):
        trainer.load_run_config(CONFIGS / "tiny.yaml", ["train.global_batch=8"])
    with pytest.raises(ValueError, match=r"data.seq_len=4096 exceeds model.max_seq_len=1024"):
        trainer.load_run_config(CONFIGS / "tiny.yaml", ["data.seq_len=4096"])
