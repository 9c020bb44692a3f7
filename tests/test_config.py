"""rag_jax.config + the run config: YAML presets, key=value overrides, clear errors for bad keys/types."""
from pathlib import Path

import pytest

from rag_jax.config import ConfigError, load_config, parse_overrides
from rag_jax.train.trainer import RunConfig, load_run_config

CONFIGS = Path(__file__).resolve().parents[1] / "train" / "configs"
# The presets of `python -m train.train` (block/grit/em_llm configs belong to their own scripts).
TRAIN_PRESETS = ("tiny.yaml", "demo_cpu.yaml", "llama3_8b_v5p.yaml", "llama3.2_1b_h200.yaml")


@pytest.mark.parametrize("name", TRAIN_PRESETS)
def test_every_train_preset_loads(name):
    path = CONFIGS / name
    cfg = load_run_config(path)
    assert isinstance(cfg, RunConfig)


def test_preset_and_overrides_are_typed():
    cfg = load_run_config(CONFIGS / "tiny.yaml", ["optimizer.learning_rate=1e-3", "train.steps=7", "mesh.fsdp=2",
                                                   "mesh.data=-1", "model.num_layers=3", "data.num_shards=null",
                                                   "logging.progress_bar=false", "checkpoint.dir=/tmp/x"])
    assert cfg.optimizer.learning_rate == 1e-3 and isinstance(cfg.optimizer.learning_rate, float)
    assert cfg.train.steps == 7 and cfg.mesh.fsdp == 2 and cfg.mesh.data == -1
    # the preset ("tiny") supplies the rest of the model; YAML and override fields win over it
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.vocab_size) == (3, 64, 512)
    assert cfg.data.num_shards is None and cfg.logging.progress_bar is False
    assert cfg.checkpoint.dir == "/tmp/x"
    # YAML 1.1 reads "3.0e-3" as a float, "1e-3"-style strings are converted for float fields
    assert load_run_config(None, ["optimizer.learning_rate=2e-4"]).optimizer.learning_rate == 2e-4


def test_model_preset_recomputes_derived_fields():
    cfg = load_run_config(None, ["model.preset=llama3-8b", "model.hidden_size=2048"])
    assert cfg.model.head_dim == 2048 // 32  # derived from the overridden width, not the preset's 128


@pytest.mark.parametrize("overrides, match", [
    (["train.stpes=3"], r"unknown config key 'train.stpes'.*did you mean 'train.steps'"),
    (["trian.steps=3"], r"unknown config key 'trian'"),
    (["train.steps=three"], r"train.steps='three' must be an int"),
    (["train.steps=3", "train.steps=4"], r"'train.steps' is set twice"),
    (["train.steps"], r"must look like key=value"),
    (["train=3"], r"train is a section"),
    (["optimizer.decay=exponential"], r"optimizer.decay='exponential' is not one of"),
    (["train.precision=fp8"], r"train.precision='fp8'"),
    (["model.preset=gpt5"], r"model.preset='gpt5' is not a known preset"),
    (["model.num_kv_heads=3"], r"invalid model: num_kv_heads=3 must divide num_heads=4"),
    (["logging.progress_bar=maybe"], r"must be a bool"),
])
def test_bad_overrides_are_rejected_clearly(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_run_config(CONFIGS / "tiny.yaml", overrides)


def test_bad_yaml_is_rejected_clearly(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("train:\n  steps: 3\n  steps: 4\n")
    with pytest.raises(ConfigError, match=r"key 'steps' is set twice .*line 3"):
        load_run_config(dup)
    typo = tmp_path / "typo.yaml"
    typo.write_text("optimizer:\n  learning_rat: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'optimizer.learning_rat'"):
        load_run_config(typo)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("train:\n  steps: 2.5\n")
    with pytest.raises(ConfigError, match=r"train.steps=2.5 must be an int, got float"):
        load_run_config(wrong)
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "missing.yaml")


def test_overlapping_override_keys_rejected():
    with pytest.raises(ConfigError, match="overlap"):
        parse_overrides(["a.b=1", "a.b.c=2"])


def test_rules_table_override():
    cfg = load_config(RunConfig, None, ['rules=[["batch", ["data"]], ["embed", ["fsdp"]]]'])
    assert cfg.rules == (("batch", ("data",)), ("embed", ("fsdp",)))


def test_a_partial_section_keeps_the_fields_own_default():
    """A section's defaults are its parent field's default (value or ``default_factory``), not the section
    class's: ``train.steps=5`` keeps the recipe's batch size, an absent section is the factory's instance, and a
    preset starts from the preset alone."""
    import dataclasses

    from rag_jax.config import load_config
    from rag_jax.model import ModelConfig

    @dataclasses.dataclass(frozen=True)
    class Inner:
        steps: int = 1
        batch: int = 2

    @dataclasses.dataclass(frozen=True)
    class Outer:
        inner: Inner = dataclasses.field(default_factory=lambda: Inner(steps=10, batch=20))
        fixed: Inner = Inner(steps=7, batch=8)
        model: ModelConfig = dataclasses.field(default_factory=ModelConfig.tiny)

    assert load_config(Outer) == Outer()
    cfg = load_config(Outer, None, ["inner.steps=5", "fixed.batch=9"])
    assert cfg.inner == Inner(steps=5, batch=20) and cfg.fixed == Inner(steps=7, batch=9)
    assert load_config(Outer, None, ["model.num_layers=3"]).model == dataclasses.replace(ModelConfig.tiny(),
                                                                                          num_layers=3)
    preset = load_config(Outer, None, ["model.preset=smollm2-135m"]).model
    assert preset.hidden_size == 576 and preset.max_seq_len != ModelConfig.tiny().max_seq_len
