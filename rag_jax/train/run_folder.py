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
    import yaml

    from rag_jax import config as config_lib
    from rag_jax import sharding
    from rag_jax.data.tokenizer import load_tokenizer
    from rag_jax.model.config import ModelConfig
    from rag_jax.train import optim
    from rag_jax.train import step as step_lib
    from rag_jax.train.checkpoint import CheckpointConfig, Checkpointer, abstract_with_shardings

    path = Path(path)
    for name in REQUIRED:
        if not (path / name).exists():
            raise FileNotFoundError(f"{path / name} not found; pass a run folder (rag-jax train / rag-jax demo "
                                    f"output, with {', '.join(REQUIRED)})")
    raw = yaml.safe_load((path / "config.yaml").read_text()) or {}
    missing = [k for k in ("model", "optimizer", "train") if not isinstance(raw.get(k), dict)]
    if missing:
        raise ValueError(f"{path / 'config.yaml'} lacks the section(s) {missing} a run folder's config has")
    model_cfg = config_lib.from_dict(ModelConfig, raw["model"], prefix="model.")
    opt_cfg = config_lib.from_dict(optim.OptimizerConfig, raw["optimizer"], prefix="optimizer.")
    train = raw["train"]
    steps, seed, precision = int(train.get("steps", 1)), int(train.get("seed", 0)), train.get("precision", "fp32")
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
