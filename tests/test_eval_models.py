"""``load_for_eval`` (``--model`` of every evaluation script): a run folder or an HF folder, the same weights back."""
import jax
import numpy as np
import pytest
from flax import nnx

from rag_jax.tokenizer import byte_tokenizer, save_tokenizer
from rag_jax.evaluation.models import load_for_eval, rag_settings
from rag_jax.model import ModelConfig, Transformer

CFG = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                  max_seq_len=160)


def _same(a, b) -> None:
    la, lb = jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param))
    assert len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_hf_folder(tmp_path):
    from rag_jax.model.hf import save_hf
    model = Transformer(CFG, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30))))
    save_hf(model, tmp_path / "hf")
    loaded = load_for_eval(tmp_path / "hf")
    assert loaded.kind == "hf" and loaded.tokenizer is None and loaded.run_config == {}
    _same(loaded.model, model)
    save_tokenizer(byte_tokenizer(), tmp_path / "hf")
    assert load_for_eval(tmp_path / "hf").tokenizer.encode("ab").ids == [97, 98]


def test_run_folder_of_the_passkey_trainer(tmp_path):
    """A run folder written by ``trainer.run`` (the passkey reader: byte tokenizer) loads as the trained model."""
    from rag_jax.recipes.em_llm.passkey import train_model
    model = train_model(CFG, steps=2, batch=2, seq_len=160, lr=1e-3, seed=0, run_dir=tmp_path / "run", progress=False)
    loaded = load_for_eval(tmp_path / "run")
    assert loaded.kind == "run" and loaded.config.hidden_size == 32
    assert loaded.tokenizer.encode("key:1").ids == list(b"key:1")
    _same(loaded.model, model)
    settings = rag_settings(loaded.run_config)         # no demo sections: the demo's defaults
    assert settings.task.num_passages >= 1 and settings.passage_max_len == 256


def test_bad_paths(tmp_path):
    for path, what in ((tmp_path / "nothing", "not found"),
                       (tmp_path / "empty", "has neither config.json nor config.yaml")):
        path.mkdir() if path.name == "empty" else None
        with pytest.raises(FileNotFoundError, match=f"--model: model path '{path}': {what}") as e:
            load_for_eval(path)
        assert "an embedded model name" in str(e.value) and "HF folder with config.json or a run folder" in str(e.value)
    with pytest.raises(ValueError, match="task.num_passages"):
        rag_settings({"task": {"num_passages": 0}})
    # the grit section is typed like the others: read back by the class the demo writes it with
    n = int(np.random.default_rng().integers(1, 999))
    got = rag_settings({"grit": {"instruction": "Find it", "passage_max_len": n}})
    assert (got.grit_instruction, got.passage_max_len) == ("Find it", n)
    with pytest.raises(ValueError, match="grit.passage_len"):
        rag_settings({"grit": {"passage_len": 64}})
    with pytest.raises(ValueError, match="grit.passage_max_len"):
        rag_settings({"grit": {"passage_max_len": 0}})
