"""Run folders: what ``rag_jax.train.trainer.run`` writes, read back as a model.

A run folder holds ``config.yaml`` (complete and self-contained: its ``model``, ``optimizer`` and ``train``
sections rebuild the train state), ``tokenizer.json``, ``metrics.jsonl``, ``tensorboard/`` and the orbax
steps under ``checkpoints/``. ``rag-jax demo`` output folders are run folders too.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

REQUIRED = ("config.yaml", "tokenizer.json", "checkpoints")


def is_run_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` looks like a run folder (``config.yaml`` and ``checkpoints/``)."""
    path = Path(path)
    return (path / "config.yaml").is_file() and (path / "checkpoints").is_dir()


def read_run_config(file: str | os.PathLike):
    """Parse a run folder's ``config.yaml``: ``(raw dict, ModelConfig, OptimizerConfig, (steps, seed, precision))``.

    Raises:
      FileNotFoundError: no such file.
      ValueError: one line naming the file and the field: not YAML, not a mapping, a missing section, a
        key or value the typed configs reject, or ``train.steps`` / ``seed`` / ``precision`` malformed.
    """
    import yaml

    from rag_jax import config as config_lib
    from rag_jax.model.config import ModelConfig
    from rag_jax.train import optim
    from rag_jax.train.step import PRECISIONS

    file = Path(file)
    try:
        raw = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as e:
        reason = " ".join(str(e).split())[:200]
        raise ValueError(f"{file} is not valid YAML ({reason})") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a mapping of sections; got {type(raw).__name__}")
    missing = [k for k in ("model", "optimizer", "train") if not isinstance(raw.get(k), dict)]
    if missing:
        raise ValueError(f"{file} lacks the section(s) {missing} a run folder's config has")
    try:
        model_cfg = config_lib.from_dict(ModelConfig, raw["model"], prefix="model.")
        opt_cfg = config_lib.from_dict(optim.OptimizerConfig, raw["optimizer"], prefix="optimizer.")
    except (ValueError, TypeError) as e:
        raise ValueError(f"{file}: {' '.join(str(e).split())}") from None
    train = raw["train"]
    checked = []
    for key, default, ok in (("steps", 1, lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
                             ("seed", 0, lambda v: isinstance(v, int) and not isinstance(v, bool)),
                             ("precision", "fp32", lambda v: v in PRECISIONS)):
        value = train.get(key, default)
        if not ok(value):
            raise ValueError(f"{file}: train.{key}={value!r:.80} is not valid"
                             + (f"; valid: {list(PRECISIONS)}" if key == "precision" else ""))
        checked.append(value)
    return raw, model_cfg, opt_cfg, tuple(checked)


def load_run(path: str | os.PathLike) -> tuple[dict[str, Any], Any, Any, Any]:
    """Load the latest complete step of a run folder on one device.

    Returns:
      ``(config: dict, graphdef, params, tokenizer)``: the resolved ``config.yaml`` as a dict (its
      ``model`` section is a ``ModelConfig``), and ``(graphdef, params)`` the model for ``BlockAttention``
      / ``GritEmbedder`` / ``generate`` (``nnx.merge(graphdef, params)`` is the module).

    Raises:
      FileNotFoundError: the folder, its ``config.yaml``, ``tokenizer.json`` or orbax steps are missing.
      ValueError: a ``config.yaml`` without valid ``model`` / ``optimizer`` / ``train`` sections.
    """
    import jax

    from rag_jax import sharding
    from rag_jax.data.tokenizer import load_tokenizer
    from rag_jax.train import optim
    from rag_jax.train import step as step_lib
    from rag_jax.train.checkpoint import CheckpointConfig, Checkpointer, abstract_with_shardings

    path = Path(path)
    for name in REQUIRED:
        if not (path / name).exists():
            raise FileNotFoundError(f"{path / name} not found; pass a run folder (rag-jax train / rag-jax demo "
                                    f"output, with {', '.join(REQUIRED)})")
    raw, model_cfg, opt_cfg, (steps, seed, precision) = read_run_config(path / "config.yaml")
    tokenizer = load_tokenizer(path / "tokenizer.json")
    tx = optim.make_optimizer(opt_cfg, steps)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
    graphdef, abstract, specs = step_lib.abstract_train_state(step_lib.apply_precision(model_cfg, precision), tx,
                                                              seed=seed)
    shardings = step_lib.train_state_shardings(abstract, specs, tx, mesh)
    ckpt = Checkpointer(CheckpointConfig(dir=str(path / "checkpoints"), async_save=False))
    try:
        restored = ckpt.restore_latest(abstract_with_shardings(abstract, shardings))
    finally:
        ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"{path / 'checkpoints'} holds no complete checkpoint step")
    return {**raw, "model": model_cfg}, graphdef, restored[1].params, tokenizer
