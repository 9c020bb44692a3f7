"""The training run: config -> mesh -> sharded state -> (resume) -> step loop with logging, eval, checkpoints.

``RunConfig`` nests each component's config; ``run(cfg)`` is what ``python -m train.train`` calls after
``rag_jax.distributed.initialize()``. Every input check (mesh size, batch divisibility, dataset and
tokenizer presence, sequence length) runs before anything is compiled.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from tqdm import tqdm

from rag_jax import config as config_lib
from rag_jax import sharding
from rag_jax.data import pipeline
from rag_jax.data.tokenizer import load_tokenizer
from rag_jax.model import ModelConfig
from rag_jax.model.transformer import REMAT_POLICIES
from rag_jax.train import checkpoint as ckpt_lib
from rag_jax.train import metrics as metrics_lib
from rag_jax.train import optim, step as step_lib
from rag_jax.train.objectives import LMLoss

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Attributes:
      steps: optimizer steps of the whole run (a resumed run continues up to it).
      global_batch_size: rows per optimizer step over all devices (multiple of the data-parallel size
        times grad_accum_steps).
      grad_accum_steps: micro-batches per step.
      seed: parameter init and per-step PRNG seed.
      precision: "fp32", "bf16" (bf16 compute, fp32 master params/optimizer) or "bf16_pure".
      remat_policy: "none", "full" (recompute each layer in backward) or "dots" (save matmul outputs).
      objective: "lm" (packed, block mask), "lm_causal", or "package.module:attr" naming a loss_fn or a
        class whose no-argument instance is one.
      log_every / eval_every: steps between log lines / held-out evaluations (0 = only at the end).
      run_dir: folder for metrics.jsonl, TensorBoard events and the resolved config; None = no files.
    """

    steps: int = 100
    global_batch_size: int = 8
    grad_accum_steps: int = 1
    seed: int = 0
    precision: str = "fp32"
    remat_policy: str = "none"
    objective: str = "lm"
    log_every: int = 10
    eval_every: int = 0
    run_dir: str | None = None

    def __post_init__(self):
        for name in ("steps", "global_batch_size", "grad_accum_steps", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 1")
        if self.eval_every < 0:
            raise ValueError(f"train.eval_every={self.eval_every} must be >= 0")
        if self.precision not in step_lib.PRECISIONS:
            raise ValueError(f"train.precision={self.precision!r}; valid: {step_lib.PRECISIONS}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"train.remat_policy={self.remat_policy!r}; valid: {REMAT_POLICIES}")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Attributes:
      jsonl / tensorboard: write metrics.jsonl / TensorBoard events under train.run_dir.
      progress_bar: tqdm bar with loss, tokens/s and step time (process 0).
      peak_flops_per_device: FLOP/s for MFU; None = look up the device kind (TPU/GPU), no MFU on CPU.
    """

    jsonl: bool = True
    tensorboard: bool = True
    progress_bar: bool = True
    peak_flops_per_device: float | None = None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig.tiny)
    mesh: sharding.MeshConfig = dataclasses.field(default_factory=sharding.MeshConfig)
    rules: tuple[tuple[str, tuple[str, ...]], ...] = sharding.DEFAULT_RULES
    optimizer: optim.OptimizerConfig = dataclasses.field(default_factory=optim.OptimizerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: pipeline.DataConfig = dataclasses.field(default_factory=pipeline.DataConfig)
    checkpoint: ckpt_lib.CheckpointConfig = dataclasses.field(default_factory=ckpt_lib.CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

    def __post_init__(self):
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")


def load_run_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """RunConfig from a YAML preset (train/configs/*.yaml) and ``key=value`` overrides (see rag_jax.config)."""
    return config_lib.load_config(RunConfig, path, overrides)


def resolve_objective(name: str) -> Callable:
    """``lm`` / ``lm_causal`` or ``package.module:attr`` -> a hashable loss_fn.

    Raises ValueError for an unknown name or an import path that cannot be loaded.
    """
    if name == "lm":
        return LMLoss("block")
    if name == "lm_causal":
        return LMLoss("causal")
    if ":" not in name:
        raise ValueError(f"train.objective={name!r}; valid: 'lm', 'lm_causal' or 'package.module:attr'")
    module, _, attr = name.partition(":")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"train.objective={name!r} cannot be loaded: {e}") from e
    return obj() if isinstance(obj, type) else obj


class Run:
    """The pieces of a run, built and validated without compiling anything (``build``)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        tc = cfg.train
        self.model_cfg = step_lib.apply_precision(cfg.model, tc.precision)
        self.mesh = sharding.make_mesh(cfg.mesh)
        sharding.check_global_batch(tc.global_batch_size, self.mesh, cfg.rules, tc.grad_accum_steps)
        self.tokenizer_path = pipeline.check_dataset(cfg.data, cfg.model.vocab_size)
        tok_vocab = load_tokenizer(self.tokenizer_path).get_vocab_size()
        if tok_vocab > cfg.model.vocab_size:
            raise ValueError(f"tokenizer {self.tokenizer_path} has {tok_vocab} tokens but model.vocab_size="
                             f"{cfg.model.vocab_size}")
        self.loss_fn = resolve_objective(tc.objective)
        self.schedule = optim.learning_rate_schedule(cfg.optimizer, tc.steps)
        self.tx = optim.make_optimizer(cfg.optimizer, tc.steps)
        self.batch_sharding = NamedSharding(self.mesh, sharding.logical_to_spec(("batch",), self.mesh, cfg.rules))
        self.rows = pipeline.host_rows(self.batch_sharding, tc.global_batch_size)
        self.flops_per_token = metrics_lib.train_flops_per_token(self.model_cfg, cfg.data.seq_len)
        self.peak = metrics_lib.peak_flops_per_device(self.mesh.devices.flat[0], cfg.logging.peak_flops_per_device)

    def dataset(self, split: str, shuffle: bool):
        return pipeline.make_lm_dataset(self.cfg.data, split=split, global_batch=self.cfg.train.global_batch_size,
                                        tokenizer_path=self.tokenizer_path, row_range=self.rows, shuffle=shuffle)

    def to_global(self, host_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return sharding.to_global(host_batch, self.mesh, self.cfg.train.global_batch_size, self.cfg.rules)


def _evaluate(run: Run, eval_step, params) -> dict[str, float]:
    totals: dict[str, float] = {}
    weight = 0.0
    it = iter(run.dataset("validation", shuffle=False))
    for _ in range(run.cfg.data.eval_batches):
        m = jax.device_get(eval_step(params, run.to_global(next(it))))
        w = float(m.get("num_tokens", 1.0))
        for k, v in m.items():
            totals[k] = totals.get(k, 0.0) + (float(v) if k == "num_tokens" else w * float(v))
        weight += w
    return {k: v if k == "num_tokens" else v / max(weight, 1e-9) for k, v in totals.items()}


def run(cfg: RunConfig) -> dict[str, Any]:
    """Train per ``cfg``; returns ``{"step", "train_loss", "eval": [(step, metrics), ...]}``.

    Raises:
      ValueError / FileNotFoundError: bad config or inputs (before compiling).
    """
    r = Run(cfg)
    tc, is_main = cfg.train, jax.process_index() == 0
    if tc.run_dir and is_main:
        Path(tc.run_dir).mkdir(parents=True, exist_ok=True)
        import yaml
        (Path(tc.run_dir) / "config.yaml").write_text(yaml.safe_dump(config_lib.to_dict(cfg), sort_keys=False))
    writer = metrics_lib.MetricWriter(tc.run_dir, jsonl=cfg.logging.jsonl, tensorboard=cfg.logging.tensorboard)

    graphdef, state, shardings = step_lib.init_train_state(r.model_cfg, r.tx, r.mesh, seed=tc.seed,
                                                           remat_policy=tc.remat_policy, rules=cfg.rules)
    train_iter = iter(r.dataset("train", shuffle=True))
    checkpointer = (ckpt_lib.Checkpointer(cfg.checkpoint, fingerprint=ckpt_lib.run_fingerprint(cfg))
                    if cfg.checkpoint.dir else None)
    if checkpointer is not None:
        restored = checkpointer.restore_latest(ckpt_lib.abstract_with_shardings(state, shardings), train_iter)
        if restored is not None:
            log.info("resumed from checkpoint step %d in %s", restored[0], cfg.checkpoint.dir)
            state = restored[1]

    train_step = step_lib.make_train_step(graphdef, r.tx, r.loss_fn, shardings, r.mesh,
                                          accum_steps=tc.grad_accum_steps, seed=tc.seed, rules=cfg.rules,
                                          learning_rate_fn=r.schedule)
    eval_step = step_lib.make_eval_step(graphdef, r.loss_fn, shardings, r.mesh, cfg.rules)
    start = int(jax.device_get(state.step))
    batch = r.to_global(next(train_iter))
    compiled = train_step.lower(state, batch).compile()
    mem = compiled.memory_analysis()
    if mem is not None and is_main:
        log.info("train step memory per device: %s", _memory_summary(mem))

    history: list[tuple[int, dict]] = []
    if tc.eval_every and start == 0 and cfg.data.eval_batches:
        history.append((0, _evaluate(r, eval_step, state.params)))
        writer.write(0, history[-1][1], prefix="eval/")
    tokens_per_step = tc.global_batch_size * cfg.data.seq_len
    bar = tqdm(total=tc.steps, initial=start, disable=not (is_main and cfg.logging.progress_bar), dynamic_ncols=True)
    last_t, last_step, train_loss = time.perf_counter(), start, math.nan
    for step in range(start + 1, tc.steps + 1):
        state, metrics = compiled(state, batch)
        if checkpointer is not None:
            checkpointer.save(step, state, train_iter, force=step == tc.steps)
        if step < tc.steps:
            batch = r.to_global(next(train_iter))  # overlaps the running step
        if step % tc.log_every == 0 or step == tc.steps:
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            step_time = (now - last_t) / (step - last_step)
            tok_s = tokens_per_step / step_time
            metrics.update(step_time_s=step_time, tokens_per_s=tok_s,
                           mfu=metrics_lib.mfu(tok_s, r.flops_per_token, r.mesh.size, r.peak),
                           flops_per_token=r.flops_per_token)
            writer.write(step, metrics, prefix="train/")
            train_loss = metrics["loss"]
            bar.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{tok_s:,.0f}", step_s=f"{step_time:.3f}")
            last_t, last_step = now, step
        bar.update(1)
        if (tc.eval_every and step % tc.eval_every == 0) or (step == tc.steps and cfg.data.eval_batches):
            history.append((step, _evaluate(r, eval_step, state.params)))
            writer.write(step, history[-1][1], prefix="eval/")
    bar.close()
    if checkpointer is not None:
        checkpointer.close()
    writer.close()
    return {"step": int(jax.device_get(state.step)), "train_loss": train_loss, "eval": history, "state": state,
            "graphdef": graphdef}


def _memory_summary(mem) -> str:
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    return ", ".join(f"{f.replace('_size_in_bytes', '')}={getattr(mem, f, 0) / 2**20:.1f} MiB" for f in fields)
