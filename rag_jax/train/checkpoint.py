"""Orbax checkpoints of the train state plus the grain data-iterator state.

``orbax.checkpoint.CheckpointManager``: async saves every ``save_every`` steps, the last ``keep`` kept.
Orbax writes each step into a temporary folder and renames it when complete, so a save cut off by a
crash is never listed (atomic). A listed step that still fails to read (truncated or corrupted files)
is reported in the log, renamed aside to ``<step>.damaged-<time>`` (so the resumed run can save that
step again) and the next older step is tried (``restore_latest``).

Resume checks what it resumes:
- a fingerprint of the run (``run_fingerprint``: model, data, seed, objective) is stored as
  ``FINGERPRINT`` in the folder; a run with another fingerprint is refused with the differing keys
  named (``CheckpointConfig.allow_config_mismatch`` overrides);
- a checkpoint whose array shapes differ from the model being restored is a one-line ValueError
  naming the first differing parameter, never mistaken for damage;
- ``LOCK`` (an ``fcntl.flock``, released when the process dies) keeps a second run out of a folder
  in use: it gets a one-line ``CheckpointError`` instead of a mixed result.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from rag_jax.atomic import write_text
from rag_jax.config import to_dict

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Attributes:
      dir: checkpoint root folder (local path or a GCS/S3 URL orbax understands); None = no checkpoints.
      save_every: save every this many optimizer steps (the final step is always saved).
      keep: keep the latest ``keep`` complete checkpoints.
      async_save: write in a background thread while training continues.
      allow_config_mismatch: resume even when the folder's run fingerprint differs (logged).
    """

    dir: str | None = None
    save_every: int = 100
    keep: int = 3
    async_save: bool = True
    allow_config_mismatch: bool = False

    def __post_init__(self):
        if self.save_every < 1 or self.keep < 1:
            raise ValueError(f"checkpoint.save_every={self.save_every} and checkpoint.keep={self.keep} must be >= 1")


class CheckpointError(RuntimeError, ValueError):
    """The checkpoint folder cannot be used (locked by another run, or no step readable). A RuntimeError,
    and a ValueError so that CLIs reporting user errors as one line report it too."""


FINGERPRINT = "run_fingerprint.json"
LOCK = ".lock"
_HELD_LOCKS: dict[str, list] = {}  # folder -> [open lock file, users in this process]


def run_fingerprint(run_cfg) -> dict:
    """What makes a resumed run the same run: ``{"model", "data", "seed", "objective"}`` as plain values
    (``run_cfg``: a RunConfig, or anything with ``.model``, ``.data`` and ``.train.seed/.objective``)."""
    model = {k: v for k, v in to_dict(run_cfg.model).items() if k != "attention_impl"}  # a kernel, not the model
    if not model.get("lora_rank"):            # no adapters: the fingerprint of runs from before they existed
        model = {k: v for k, v in model.items() if k not in ("lora_rank", "lora_targets")}
    return json.loads(json.dumps({"model": model, "data": to_dict(run_cfg.data),
                                  "seed": run_cfg.train.seed, "objective": run_cfg.train.objective}))


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): d}


def fingerprint_diff(stored: dict, current: dict) -> list[str]:
    """``["model.num_layers: 2 (checkpoint) vs 4 (this run)", ...]`` for every differing key."""
    a, b = _flat(stored), _flat(current)
    return [f"{k}: {a.get(k, '<unset>')!r} (checkpoint) vs {b.get(k, '<unset>')!r} (this run)"
            for k in sorted(set(a) | set(b)) if a.get(k, "<unset>") != b.get(k, "<unset>")]


def _shapes(tree) -> dict[str, tuple]:
    """``{"params/layers/0/attn/wq/value": shape}``: the same keys for a live tree and orbax's metadata tree
    (which stores attributes and tuple positions as dict keys)."""
    def name(k):
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(name(k) for k in path): tuple(getattr(v, "shape", ())) for path, v in leaves}


def _lock(folder: Path) -> None:
    key = str(folder)
    if key in _HELD_LOCKS:
        _HELD_LOCKS[key][1] += 1
        return
    f = open(folder / LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise CheckpointError(f"checkpoint folder {folder} is in use by another run ({holder}); wait for it to "
                           "finish or set checkpoint.dir to another folder") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    _HELD_LOCKS[key] = [f, 1]


def _unlock(folder: Path) -> None:
    held = _HELD_LOCKS.get(str(folder))
    if held is None:
        return
    held[1] -= 1
    if held[1] == 0:
        held[0].close()  # releases the flock
        del _HELD_LOCKS[str(folder)]


class Checkpointer:
    """Saves ``{"state": pytree, "data_iter": grain iterator}`` per step under ``cfg.dir``.

    Args:
      cfg: the checkpoint settings.
      fingerprint: ``run_fingerprint(run_cfg)``; stored on first use and compared on later ones.

    Raises:
      CheckpointError: the (local) folder is locked by another live process.
      ValueError: ``fingerprint`` differs from the stored one (the message lists the differing keys)
        and ``cfg.allow_config_mismatch`` is False.
    """

    def __init__(self, cfg: CheckpointConfig, fingerprint: dict | None = None):
        if cfg.dir is None:
            raise ValueError("checkpoint.dir is not set")
        self.cfg = cfg
        self._local = Path(cfg.dir).absolute() if "://" not in cfg.dir else None
        self._locked = self._local is not None and jax.process_index() == 0
        if self._locked:
            self._local.mkdir(parents=True, exist_ok=True)
            _lock(self._local)
        try:
            options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
                                                   create=True)
            self.manager = ocp.CheckpointManager(self._local or cfg.dir, options=options,
                                                 item_names=("state", "data_iter"))
            if fingerprint is not None:
                self._check_fingerprint(fingerprint)
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        if self._locked:
            self._locked = False
            _unlock(self._local)

    def _check_fingerprint(self, fingerprint: dict) -> None:
        path = self.manager.directory / FINGERPRINT
        if path.exists():
            try:
                stored = json.loads(path.read_text())
            except ValueError as e:
                raise ValueError(f"{path} is corrupt ({e}); restore it or use another checkpoint.dir") from None
            diff = fingerprint_diff(stored, fingerprint)
            if diff and not self.cfg.allow_config_mismatch:
                raise ValueError(f"checkpoint folder {self.cfg.dir} belongs to another run: {'; '.join(diff[:5])}"
                                 f"{f' (+{len(diff) - 5} more)' if len(diff) > 5 else ''}; use another "
                                 "checkpoint.dir or set checkpoint.allow_config_mismatch=true to resume anyway")
            if diff:
                log.warning("resuming %s despite a different run config (allow_config_mismatch): %s",
                            self.cfg.dir, "; ".join(diff))
            return
        if self.all_steps():
            log.warning("checkpoint folder %s has steps but no %s (older rag_jax); recording this run's",
                        self.cfg.dir, FINGERPRINT)
        if jax.process_index() == 0:  # atomic: other processes may be reading it
            text = json.dumps(fingerprint, indent=1, sort_keys=True)
            if self._local is not None:
                write_text(self._local / FINGERPRINT, text)
            else:
                path.write_text(text)

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

    def check_shapes(self, step: int, abstract_state: Any) -> None:
        """Raise a one-line ValueError when ``step``'s saved arrays differ in structure or shape from
        ``abstract_state`` (a checkpoint of another model config). Unreadable metadata is left to restore."""
        try:
            saved = ocp.StandardCheckpointHandler().metadata(self.manager.directory / str(step) / "state")
        except Exception:  # damaged metadata: restore reports it as damage
            return
        want, have = _shapes(abstract_state), _shapes(saved)
        where = f"checkpoint step {step} in {self.cfg.dir}"
        for key in sorted(set(want) | set(have), key=lambda k: (not k.startswith("params"), k)):
            if key not in have or key not in want:
                what = (f"this model's {key} is missing from the checkpoint" if key not in have else
                        f"the checkpoint holds {key}, which this model lacks")
                raise ValueError(f"{where} does not match the model: {what}; it was written by another model "
                                 "config (use that config or another checkpoint.dir)")
            if have[key] != want[key]:
                raise ValueError(f"{where} does not match the model: {key} has shape {have[key]} in the checkpoint, "
                                 f"{want[key]} in this model config (use that config or another checkpoint.dir)")

    def restore(self, step: int, abstract_state: Any, data_iter: grain.DatasetIterator | None = None) -> Any:
        """Restore ``step`` into the shapes/shardings of ``abstract_state`` (ShapeDtypeStruct leaves with
        ``sharding``); the data iterator's position is restored in place.

        Raises:
          ValueError: the checkpoint holds another model config (``check_shapes``).
        """
        self.check_shapes(step, abstract_state)
        items = {"state": ocp.args.StandardRestore(abstract_state)}
        if data_iter is not None:
            items["data_iter"] = grain.checkpoint.CheckpointRestore(data_iter)
        return self.manager.restore(step, args=ocp.args.Composite(**items))["state"]

    def restore_latest(self, abstract_state: Any, data_iter: grain.DatasetIterator | None = None
                       ) -> tuple[int, Any] | None:
        """Restore the newest readable step: ``(step, state)``, or None when there is no checkpoint.

        An unreadable step is logged (warning, with the error) and skipped for the previous one; once an
        older step restores, the unreadable newer ones are renamed ``<step>.damaged-<time>`` (kept for
        inspection; no longer listed, so the run saves those steps again).

        Raises:
          ValueError: the newest step holds another model config (one line; nothing renamed).
          CheckpointError: checkpoints exist but none can be read (one line; nothing renamed).
        """
        steps = self.all_steps()
        errors, damaged = [], []
        for step in reversed(steps):
            self.check_shapes(step, abstract_state)
            try:
                state = self.restore(step, abstract_state, data_iter)
            except Exception as e:  # orbax/tensorstore raise many types for damaged files
                first = (str(e).strip().splitlines() or [""])[0][:300]
                errors.append(f"step {step}: {type(e).__name__}: {first}")
                damaged.append(step)
                log.warning("checkpoint step %d in %s is unreadable (%s: %s); falling back to the previous step",
                            step, self.cfg.dir, type(e).__name__, first)
                continue
            if errors:
                log.warning("restored checkpoint step %d after skipping unreadable steps %s", step, damaged)
                self._set_aside(damaged)
            return step, state
        if errors:
            raise CheckpointError(f"no readable checkpoint in {self.cfg.dir}: " + "; ".join(errors) +
                               " (move the damaged step folders away or use another checkpoint.dir)")
        return None

    def _set_aside(self, steps: list[int]) -> None:
        if jax.process_index() == 0:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for step in steps:
                src = self.manager.directory / str(step)
                if src.exists():
                    dst, i = src.parent / f"{step}.damaged-{stamp}", 1
                    while dst.exists():
                        dst, i = src.parent / f"{step}.damaged-{stamp}-{i}", i + 1
                    src.rename(dst)
                    log.warning("set aside damaged checkpoint step %d as %s", step, dst)
        self.manager.reload()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        try:
            self.manager.wait_until_finished()
            self.manager.close()
        finally:
            self._release()


def abstract_with_shardings(abstract_tree, shardings):
    """ShapeDtypeStructs carrying the target shardings (the restore target)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_tree, shardings)
