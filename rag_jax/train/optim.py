"""Optimizer: optax AdamW with linear warmup then cosine / linear / constant decay, global-norm clipping, and
optionally only a subset of the parameters trained (``OptimizerConfig.trainable``: partial fine-tuning, e.g. the
top layers of a pretrained model; the others are frozen bit-exactly and get no gradient computation)."""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

DECAYS = ("cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW hyper-parameters.

    Attributes:
      learning_rate: peak learning rate (after warmup).
      warmup_steps: linear warmup from 0 to the peak over this many optimizer steps.
      decay: schedule after warmup, down to ``min_lr_ratio * learning_rate`` at ``total_steps``.
      min_lr_ratio: final learning rate as a fraction of the peak.
      weight_decay: decoupled (AdamW) weight decay on matrices (ndim >= 2); norm scales are not decayed.
      b1, b2, eps: Adam moments.
      grad_clip_norm: clip the global gradient norm to this value; 0 disables.
      trainable: regular expression (``re.search``) over parameter paths such as ``layers/29/attn/wq`` or
        ``final_norm/scale`` (:func:`param_path`): only matching parameters are trained, the others stay
        frozen (zero updates, no weight decay, no gradient computed). None = all parameters are trained.
    """

    learning_rate: float = 3e-4
    warmup_steps: int = 100
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip_norm: float = 1.0
    trainable: str | None = None

    def __post_init__(self):
        if not 0 < self.learning_rate < float("inf"):  # also rejects NaN (nan <= 0 is False)
            raise ValueError(f"learning_rate={self.learning_rate} must be a finite number > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.decay not in DECAYS:
            raise ValueError(f"decay={self.decay!r}; valid: {DECAYS}")
        if self.grad_clip_norm < 0 or self.weight_decay < 0:
            raise ValueError("grad_clip_norm and weight_decay must be >= 0")
        if self.trainable is not None:
            try:
                re.compile(self.trainable)
            except re.error as e:
                raise ValueError(f"optimizer.trainable={self.trainable!r} is not a regular expression: {e}") from None


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Learning rate per optimizer step: warmup to the peak, then decay to min_lr_ratio * peak."""
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup = min(cfg.warmup_steps, total_steps)
    decay_steps = max(total_steps - warmup, 1)
    if cfg.decay == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.decay == "linear":
        decay = optax.linear_schedule(peak, end, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def _decay_mask(params):
    """Weight decay on matrices only: norm scales (1-D) are not decayed (GPT-3 / Llama practice)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def param_path(key_path) -> str:
    """``"layers/29/attn/wq"`` for the pytree key path of a parameter leaf (NNX's trailing ``.value`` dropped)."""
    parts = []
    for k in key_path:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        if isinstance(k, jax.tree_util.GetAttrKey) and name == "value":
            continue
        parts.append(str(name))
    return "/".join(parts)


def trainable_mask(cfg: OptimizerConfig, params) -> Any:
    """Pytree of bools like ``params``: True where ``cfg.trainable`` matches the :func:`param_path`; None when
    ``cfg.trainable`` is None (everything is trained). ``params`` may be abstract (``ShapeDtypeStruct`` leaves).

    Raises:
      ValueError: ``cfg.trainable`` matches no parameter (the first paths are named).
    """
    if cfg.trainable is None:
        return None
    pattern = re.compile(cfg.trainable)
    mask = jax.tree_util.tree_map_with_path(lambda path, _: bool(pattern.search(param_path(path))), params)
    if not any(jax.tree.leaves(mask)):
        paths = [param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        raise ValueError(f"optimizer.trainable={cfg.trainable!r} matches no parameter; paths look like "
                         f"{paths[:3]} ... {paths[-2:]}")
    return mask


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """``clip_by_global_norm`` -> AdamW(schedule); optimizer state mirrors params (same shardings).

    With ``cfg.trainable`` a last stateless transform sets the updates of the other parameters to exact zeros
    (frozen bit-exactly, weight decay included). The state keeps the structure of the full optimizer (so
    ``optax.tree_map_params`` shardings and checkpoints work unchanged); the train step's matching
    ``trainable`` mask makes the frozen gradients zeros, so their moments stay zero and the global norm that
    is clipped is the trainable parameters' own."""
    parts = []
    if cfg.grad_clip_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip_norm))
    parts.append(optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=_decay_mask))
    if cfg.trainable is not None:
        pattern = re.compile(cfg.trainable)

        def zero_frozen(updates, params=None):
            del params
            return jax.tree_util.tree_map_with_path(
                lambda path, u: u if pattern.search(param_path(path)) else jnp.zeros_like(u), updates)

        parts.append(optax.stateless(zero_frozen))
    return optax.chain(*parts)
