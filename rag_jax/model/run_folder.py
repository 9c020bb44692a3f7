"""Run folders: what ``rag_jax.train.trainer.run`` writes, read back as a model without its optimizer.

A run folder holds ``config.yaml`` (complete and self-contained: its ``model``, ``optimizer`` and ``train``
sections rebuild the train state), ``tokenizer.json``, ``metrics.jsonl``, ``tensorboard/`` and the orbax
steps under ``checkpoints/``. ``rag-jax demo`` output folders are run folders too.

A step stores the train state ``{"step", "params", "opt_state"}`` as its ``state`` item
(``rag_jax.train.checkpoint``). Reading a model restores the ``params`` subtree only (orbax's partial
restore, as levanter restores ``subpath="model"``): no optimizer is built and its moments are never read.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
import yaml
from flax import nnx

from rag_jax import config as config_lib
from rag_jax.model.config import PRECISIONS, ModelConfig, apply_precision
from rag_jax.model.transformer import Transformer

REQUIRED = ("config.yaml", "tokenizer.json", "checkpoints")
STATE_ITEM = "state"  # the checkpoint item holding the train state (rag_jax.train.checkpoint.Checkpointer)


def is_run_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` looks like a run folder (``config.yaml`` and ``checkpoints/``)."""
    path = Path(path)
    return (path / "config.yaml").is_file() and (path / "checkpoints").is_dir()


def read_run_config(path: str | os.PathLike) -> dict[str, Any]:
    """A run folder's ``config.yaml`` as a dict whose ``model`` entry is the ``ModelConfig``.

    Raises:
      FileNotFoundError: the folder, its ``config.yaml``, ``tokenizer.json`` or ``checkpoints/`` are missing.
      ValueError: one line naming the file: not YAML, not a mapping, a missing ``model`` / ``optimizer`` /
        ``train`` section, a ``model`` key or value ``ModelConfig`` rejects, or an unknown ``train.precision``.
    """
    path = Path(path)
    for name in REQUIRED:
        if not (path / name).exists():
            raise FileNotFoundError(f"{path / name} not found; pass a run folder (rag-jax train / rag-jax demo "
                                    f"output, with {', '.join(REQUIRED)})")
    file = path / "config.yaml"
    try:
        raw = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{file} is not valid YAML ({' '.join(str(e).split())[:200]})") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a mapping of sections; got {type(raw).__name__}")
    missing = [k for k in ("model", "optimizer", "train") if not isinstance(raw.get(k), dict)]
    if missing:
        raise ValueError(f"{file} lacks the section(s) {missing} a run folder's config has")
    try:
        model_cfg = config_lib.from_dict(ModelConfig, raw["model"], prefix="model.")
    except (ValueError, TypeError) as e:
        raise ValueError(f"{file}: {' '.join(str(e).split())}") from None
    if raw["train"].get("precision", "fp32") not in PRECISIONS:
        raise ValueError(f"{file}: train.precision={raw['train']['precision']!r:.80} is not valid; "
                         f"valid: {list(PRECISIONS)}")
    return {**raw, "model": model_cfg}


def restore_params(checkpoints: str | os.PathLike, model_cfg: ModelConfig, precision: str = "fp32",
                   step: int | None = None) -> tuple[int, nnx.GraphDef, nnx.State]:
    """The model of a checkpoint step on one device, read without the optimizer state.

    Args:
      checkpoints: the orbax folder (a run folder's ``checkpoints/``).
      model_cfg: the run's ``ModelConfig``; ``precision`` (``train.precision``) sets the stored param dtype.
      step: the step to read; None = the latest complete one.

    Returns:
      ``(step, graphdef, params)``; ``nnx.merge(graphdef, params)`` is the ``Transformer``.

    Raises:
      FileNotFoundError: no complete step (or not ``step``) in ``checkpoints``.
      ValueError: orbax's, when the stored parameters differ in structure or shape from ``model_cfg``'s.
    """
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(apply_precision(model_cfg, precision),
                                                                      rngs=nnx.Rngs(0))))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"params": jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)}
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    with ocp.CheckpointManager(Path(checkpoints).absolute(), options=options, item_names=(STATE_ITEM,)) as manager:
        steps = manager.all_steps()
        if step is None and steps:
            step = max(steps)
        if step is None or step not in steps:
            raise FileNotFoundError(f"{checkpoints} holds no complete checkpoint step"
                                    + (f" {step} (steps: {sorted(steps)})" if step is not None else ""))
        restore = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                         partial_restore=True)
        restored = manager.restore(step, args=ocp.args.Composite(**{STATE_ITEM: restore}))[STATE_ITEM]
    return step, graphdef, restored["params"]

