"""Orbax checkpoints of the train state plus the grain data-iterator state.

``orbax.checkpoint.CheckpointManager``: async saves every ``save_every`` steps, the last ``keep`` kept.
Orbax writes each step into a temporary folder and renames it when complete, so a save cut off by a
crash is never listed (atomic). A listed step that still fails to read (truncated or corrupted files)
is reported in the log and the next older step is tried (``restore_latest``).
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Attributes:
      dir: checkpoint root folder (local path or a GCS/S3 URL orbax understands); None = no checkpoints.
      save_every: save every this many optimizer steps (the final step is always saved).
      keep: keep the latest ``keep`` complete checkpoints.
      async_save: write in a background thread while training continues.
    """

    dir: str | None = None
    save_every: int = 100
    keep: int = 3
    async_save: bool = True

    def __post_init__(self):
        if self.save_every < 1 or self.keep < 1:
            raise ValueError(f"checkpoint.save_every={self.save_every} and checkpoint.keep={self.keep} must be >= 1")


class Checkpointer:
    """Saves ``{"state": pytree, "data_iter": grain iterator}`` per step under ``cfg.dir``."""

    def __init__(self, cfg: CheckpointConfig):
        if cfg.dir is None:
            raise ValueError("checkpoint.dir is not set")
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(Path(cfg.dir).absolute() if "://" not in cfg.dir else cfg.dir,
                                             options=options, item_names=("state", "data_iter"))

    def save(self, step: int, state: Any, data_iter: grain.DatasetIterator | None = None, *,
             force: bool = False) -> bool:
        """Start saving (async) if ``step`` is a multiple of ``save_every`` (or ``force``); returns whether a
        save started. (The interval is decided here: orbax's default policy also saves the first step.)"""
        if not force and step % self.cfg.save_every:
            return False
        items = {"state": ocp.args.StandardSave(state)}
        if data_iter is not None:
            items["data_iter"] = grain.checkpoint.CheckpointSave(data_iter)
        return self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def all_steps(self) -> list[int]:
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def restore(self, step: int, abstract_state: Any, data_iter: grain.DatasetIterator | None = None) -> Any:
        """Restore ``step`` into the shapes/shardings of ``abstract_state`` (ShapeDtypeStruct leaves with
        ``sharding``); the data iterator's position is restored in place."""
        items = {"state": ocp.args.StandardRestore(abstract_state)}
        if data_iter is not None:
            items["data_iter"] = grain.checkpoint.CheckpointRestore(data_iter)
        return self.manager.restore(step, args=ocp.args.Composite(**items))["state"]

    def restore_latest(self, abstract_state: Any, data_iter: grain.DatasetIterator | None = None
                       ) -> tuple[int, Any] | None:
        """Restore the newest readable step: ``(step, state)``, or None when there is no checkpoint.

        An unreadable step is logged (warning, with the error) and skipped for the previous one.

        Raises:
          RuntimeError: checkpoints exist but none can be read (each step's error in the message).
        """
        steps = self.all_steps()
        errors = []
        for step in reversed(steps):
            try:
                state = self.restore(step, abstract_state, data_iter)
            except Exception as e:  # orbax/tensorstore raise many types for damaged files
                errors.append(f"step {step}: {type(e).__name__}: {e}")
                log.warning("checkpoint step %d in %s is unreadable (%s: %s); falling back to the previous step",
                            step, self.cfg.dir, type(e).__name__, str(e)[:300])
                continue
            if errors:
                log.warning("restored checkpoint step %d after skipping unreadable steps %s", step,
                            [int(e.split()[1].rstrip(":")) for e in errors])
            return step, state
        if errors:
            raise RuntimeError(f"no readable checkpoint in {self.cfg.dir}:\n" + "\n".join(errors))
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_with_shardings(abstract_tree, shardings):
    """ShapeDtypeStructs carrying the target shardings (the restore target)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_tree, shardings)
