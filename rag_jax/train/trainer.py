"""The one training loop: ``run(config, task)`` for every training in the repository.

A **task** (:class:`Task`) is what is trained: a loss function and its batches (plus an optional held-out
evaluation and the tokenizer). The LM task over a tokenized dataset (:func:`lm_task`, the default of
``run(cfg)``), the Block-Attention, GRIT and GRIT + Block objectives, the demo, the reader pretraining and the
passkey reader are all tasks; ``run`` owns everything else (the way levanter's ``Trainer`` takes hooks):
mesh, sharded state, resume, the jitted step, logging, evaluation, checkpoints and the **run folder**:

    <train.run_dir>/config.yaml        the complete resolved config (self-contained; ``rag_jax.model.run_folder``)
    <train.run_dir>/tokenizer.json     the task's tokenizer, if it has one
    <train.run_dir>/metrics.jsonl      one JSON row per logged step (``train/...``, ``eval/...``)
    <train.run_dir>/tensorboard/       TensorBoard events
    <checkpoint.dir>/<step>/           orbax steps (default ``<run_dir>/checkpoints`` when run_dir is set)

``hooks`` are called at every logged step with a :class:`StepInfo` (progress displays, early plots, custom
evaluation). Every input check (mesh size, batch divisibility, dataset and tokenizer presence, sequence
length) runs before anything is compiled.
"""
from __future__ import annotations

import dataclasses
import json
import importlib
import logging
import math
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding

from rag_jax import config as config_lib
from rag_jax import sharding
from rag_jax.atomic import write_text
from rag_jax.data import pipeline
from rag_jax.model import ModelConfig
from rag_jax.model.config import PRECISIONS, apply_precision
from rag_jax.model.transformer import REMAT_POLICIES
from rag_jax.progress import progress_bar
from rag_jax.tokenizer import load_tokenizer, save_tokenizer
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
      remat_policy: "none", "full" (recompute each layer in backward), "dots" (save matmul outputs) or a
        MaxText-style named choice saving only some projections: "save_qkv_proj", "save_qkv_out_proj",
        "save_qkv_out_mlpwi" (``model.transformer.REMAT_NAMES``).
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
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision={self.precision!r}; valid: {PRECISIONS}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"train.remat_policy={self.remat_policy!r}; valid: {REMAT_POLICIES}")


def refuse_set_fields(train: TrainConfig, fixed: dict[str, str]) -> None:
    """For a job that sets some ``TrainConfig`` fields itself: ValueError naming the first of ``fixed``
    (``{field: why the job sets it}``) whose value in ``train`` differs from ``TrainConfig``'s default (a user value
    there would be ignored)."""
    default = TrainConfig()
    for name, why in fixed.items():
        if getattr(train, name) != getattr(default, name):
            raise ValueError(f"train.{name}={getattr(train, name)!r}: {why}; remove it")


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


@dataclasses.dataclass
class Task:
    """What a run trains.

    Attributes:
      loss_fn: hashable ``(model, batch, rng) -> (loss, metrics)`` (``rag_jax.train.objectives``); a
        ``metrics["num_tokens"]`` weights gradient-accumulation micro-batches.
      batch: ``step -> {name: np.ndarray [rows, ...]}``, the batch of 0-based ``step`` on this process.
        Deterministic in ``step`` (so a resumed run sees the same data) unless ``data_iter`` is set. Shapes
        may differ between steps (length-bucketed batches): the step is compiled once per distinct shape.
      name: shown in the progress bar.
      global_batch_size: rows per step over all processes (multi-host); None = each array's leading size
        (single process: the host batch is the global batch).
      data_iter: a grain ``DatasetIterator`` whose position is saved with each checkpoint (its batches
        are what ``batch`` returns).
      evaluate: optional ``(graphdef, params) -> {metric: float}`` held-out evaluation, run every
        ``train.eval_every`` steps and after the last step.
      tokenizer: a ``tokenizers.Tokenizer`` written to ``<run_dir>/tokenizer.json``.
      progress_keys: metrics shown in the progress bar besides the loss.
    """

    loss_fn: Callable
    batch: Callable[[int], dict[str, np.ndarray]]
    name: str = "training"
    global_batch_size: int | None = None
    data_iter: Any = None
    evaluate: Callable[[Any, Any], dict[str, float]] | None = None
    tokenizer: Any = None
    progress_keys: tuple[str, ...] = ("accuracy",)


@dataclasses.dataclass
class StepInfo:
    """What a hook sees at a logged step: the 1-based ``step``, its ``metrics`` (host floats, incl.
    ``step_time_s``, ``tokens_per_s`` when known, ``elapsed_s``) and the train ``state``."""

    step: int
    metrics: dict[str, float]
    state: Any


@dataclasses.dataclass
class TrainResult:
    """``graphdef`` + ``state`` (``nnx.merge(graphdef, state.params)`` is the model), ``history`` (the
    logged ``train/`` rows of ``metrics.jsonl``, one dict per logged step incl. ``step``), ``eval``
    (``[(step, metrics)]``), ``train_seconds`` (wall, step loop only), ``compile_seconds`` and ``start_step``
    (the checkpoint step the run resumed from; 0 = a fresh start)."""

    graphdef: Any
    state: Any
    history: list[dict]
    eval: list[tuple[int, dict]]
    train_seconds: float
    compile_seconds: float
    start_step: int = 0

    @property
    def step(self) -> int:
        return int(jax.device_get(self.state.step))

    @property
    def train_loss(self) -> float:
        return self.history[-1]["loss"] if self.history else math.nan

    def __getitem__(self, key):  # the dict interface of earlier versions: result["step"], ...
        return getattr(self, key)


def lm_task(cfg: RunConfig, mesh) -> Task:
    """Next-token LM over ``cfg.data`` (a tokenized tfds dataset; ``rag_jax.data.pipeline``) with the objective
    ``train.objective``; held-out loss over ``data.eval_batches`` validation batches.

    Raises:
      ValueError / FileNotFoundError: missing dataset or tokenizer, a tokenizer larger than the vocabulary,
        a global batch the mesh cannot split, an unknown objective.
    """
    tc = cfg.train
    sharding.check_global_batch(tc.global_batch_size, mesh, cfg.rules, tc.grad_accum_steps)
    tokenizer_path = pipeline.check_dataset(cfg.data, cfg.model.vocab_size)
    tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer.get_vocab_size() > cfg.model.vocab_size:
        raise ValueError(f"tokenizer {tokenizer_path} has {tokenizer.get_vocab_size()} tokens but model.vocab_size="
                         f"{cfg.model.vocab_size}")
    rows = pipeline.host_rows(NamedSharding(mesh, sharding.logical_to_spec(("batch",), mesh, cfg.rules)),
                              tc.global_batch_size)

    def dataset(split, shuffle):
        return pipeline.make_lm_dataset(cfg.data, split=split, global_batch=tc.global_batch_size,
                                        tokenizer_path=tokenizer_path, row_range=rows, shuffle=shuffle)

    train_iter = iter(dataset("train", True))
    loss_fn = resolve_objective(tc.objective)
    eval_steps: dict[Any, Callable] = {}

    def evaluate(graphdef, params) -> dict[str, float]:
        if not cfg.data.eval_batches:
            return {}
        if graphdef not in eval_steps:
            shardings = step_lib.TrainState(step=None, params=jax.tree.map(lambda x: x.sharding, params),
                                            opt_state=None)
            eval_steps[graphdef] = step_lib.make_eval_step(graphdef, loss_fn, shardings, mesh, cfg.rules)
        totals, weight = {}, 0.0
        it = iter(dataset("validation", False))
        for _ in range(cfg.data.eval_batches):
            m = jax.device_get(eval_steps[graphdef](params, to_global(next(it), mesh, tc.global_batch_size, cfg.rules)))
            w = float(m.get("num_tokens", 1.0))
            for k, v in m.items():
                totals[k] = totals.get(k, 0.0) + (float(v) if k == "num_tokens" else w * float(v))
            weight += w
        return {k: v if k == "num_tokens" else v / max(weight, 1e-9) for k, v in totals.items()}

    return Task(loss_fn, lambda step: next(train_iter), name=f"LM ({tc.objective})",
                global_batch_size=tc.global_batch_size, data_iter=train_iter, evaluate=evaluate, tokenizer=tokenizer)


def to_global(batch: dict[str, np.ndarray], mesh, global_batch: int | None, rules=sharding.DEFAULT_RULES) -> dict:
    """Host batch -> global ``jax.Array``s, each array's leading (batch) axis over the data-parallel mesh axes.
    ``global_batch`` None: every array's own leading size (single-process tasks)."""
    return {k: jax.make_array_from_process_local_data(
        sharding.batch_sharding(mesh, v.ndim, rules), v, ((global_batch or v.shape[0]),) + v.shape[1:])
        for k, v in batch.items()}


def _check_batch(batch: dict[str, np.ndarray], mesh, rules) -> None:
    for k, v in batch.items():
        try:
            sharding.check_global_batch(v.shape[0], mesh, rules)
        except ValueError as e:
            raise ValueError(f"batch[{k!r}] (leading size {v.shape[0]}): {e}") from None


def _write_run_files(cfg: RunConfig, task: Task, extra_config: dict | None) -> None:
    import yaml

    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = {**config_lib.to_dict(cfg), **(extra_config or {})}
    write_text(run_dir / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))
    if task.tokenizer is not None:
        save_tokenizer(task.tokenizer, run_dir / "tokenizer.json")


def run(cfg: RunConfig, task: Task | None = None, *, init_params=None, mesh=None, hooks: Sequence[Callable] = (),
        extra_config: dict | None = None) -> TrainResult:
    """Train ``task`` (default: :func:`lm_task` of ``cfg``) per ``cfg``; returns a :class:`TrainResult`.

    Args:
      cfg: model, mesh, rules, optimizer, train, checkpoint and logging sections (``cfg.data`` only for the
        LM task). With ``train.run_dir`` set, the run folder (module docstring) is written there and
        ``checkpoint.dir`` defaults to ``<run_dir>/checkpoints``.
      task: what to train.
      init_params: an ``nnx.State`` of parameters to start from (fine-tuning a base), cast to the master
        dtype; None = random init from ``train.seed``.
      mesh: a prebuilt mesh (e.g. a subset of devices); None = ``sharding.make_mesh(cfg.mesh)``.
      hooks: ``hook(StepInfo)`` callables run at every logged step on process 0.
      extra_config: sections added to ``config.yaml`` (a caller's own config, e.g. the demo's task).

    Raises:
      ValueError / FileNotFoundError: bad config or inputs (before compiling).
    """
    tc, is_main = cfg.train, jax.process_index() == 0
    model_cfg = apply_precision(cfg.model, tc.precision)
    mesh = mesh if mesh is not None else sharding.make_mesh(cfg.mesh)
    task = task if task is not None else lm_task(cfg, mesh)
    ckpt_cfg = cfg.checkpoint
    if ckpt_cfg.dir is None and tc.run_dir:
        ckpt_cfg = dataclasses.replace(ckpt_cfg, dir=str(Path(tc.run_dir) / "checkpoints"))
    schedule = optim.learning_rate_schedule(cfg.optimizer, tc.steps)
    tx = optim.make_optimizer(cfg.optimizer, tc.steps)
    first = task.batch(0)
    _check_batch(first, mesh, cfg.rules)
    if tc.run_dir and is_main:
        _write_run_files(cfg, task, extra_config)

    graphdef, state, shardings = step_lib.init_train_state(model_cfg, tx, mesh, seed=tc.seed, params=init_params,
                                                           remat_policy=tc.remat_policy, rules=cfg.rules)
    checkpointer = (ckpt_lib.Checkpointer(ckpt_cfg, fingerprint=_fingerprint(cfg, task, extra_config))
                    if ckpt_cfg.dir else None)
    start = 0
    if checkpointer is not None:
        restored = checkpointer.restore_latest(ckpt_lib.abstract_with_shardings(state, shardings), task.data_iter)
        if restored is not None:
            log.info("resumed from checkpoint step %d in %s", restored[0], ckpt_cfg.dir)
            state = restored[1]
            start = int(jax.device_get(state.step))
    writer = metrics_lib.MetricWriter(tc.run_dir, jsonl=cfg.logging.jsonl, tensorboard=cfg.logging.tensorboard,
                                      from_step=start)

    train_step = step_lib.make_train_step(graphdef, tx, task.loss_fn, shardings, mesh,
                                          accum_steps=tc.grad_accum_steps, seed=tc.seed, rules=cfg.rules,
                                          learning_rate_fn=schedule,
                                          trainable=optim.trainable_mask(cfg.optimizer, state.params))

    def device_batch(step):
        host = first if step == 0 and start == 0 else task.batch(step)
        return to_global(host, mesh, task.global_batch_size, cfg.rules)

    compiled_steps: dict = {}  # one compiled step per batch shape (tasks with length-bucketed batches)

    def compiled_for(batch):
        key = (jax.tree.structure(batch), tuple((x.shape, x.dtype) for x in jax.tree.leaves(batch)))
        if key not in compiled_steps:
            t = time.perf_counter()
            compiled_steps[key] = train_step.lower(state, batch).compile()
            if len(compiled_steps) > 1 and is_main:
                log.info("compiled the train step for batch shape %d in %.1f s", len(compiled_steps),
                         time.perf_counter() - t)
        return compiled_steps[key]

    t0 = time.perf_counter()
    batch = device_batch(start)
    mem = compiled_for(batch).memory_analysis()
    compile_s = time.perf_counter() - t0
    if mem is not None and is_main:
        log.info("train step memory per device: %s", _memory_summary(mem))
    peak = metrics_lib.peak_flops_per_device(mesh.devices.flat[0], cfg.logging.peak_flops_per_device)
    tokens_done = flops_done = 0.0  # since the last logged step (batch shapes may differ between steps)

    evals: list[tuple[int, dict]] = []

    def evaluate(step):
        if task.evaluate is None:
            return
        m = task.evaluate(graphdef, state.params)
        if m:
            evals.append((step, m))
            writer.write(step, m, prefix="eval/")

    if tc.eval_every and start == 0:
        evaluate(0)
    bar = progress_bar(enabled=is_main and cfg.logging.progress_bar, total=tc.steps, initial=start, desc=task.name,
                       unit="step", dynamic_ncols=True)
    t_start = last_t = time.perf_counter()
    last_step = start
    for step in range(start + 1, tc.steps + 1):
        tokens_done += _tokens(batch)
        flops_done += _tokens(batch) * metrics_lib.train_flops_per_token(model_cfg, _seq_len(batch))
        state, metrics = compiled_for(batch)(state, batch)
        if checkpointer is not None:
            checkpointer.save(step, state, task.data_iter, force=step == tc.steps)
        if step < tc.steps:
            batch = device_batch(step)  # host work overlaps the running step
        if step % tc.log_every == 0 or step == tc.steps:
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            step_time = (now - last_t) / (step - last_step)
            metrics.update(step_time_s=step_time, elapsed_s=now - t_start)
            if tokens_done:
                tok_s = tokens_done / (now - last_t)
                flops_per_token = flops_done / tokens_done
                metrics.update(tokens_per_s=tok_s, flops_per_token=flops_per_token,
                               mfu=metrics_lib.mfu(tok_s, flops_per_token, mesh.size, peak))
            tokens_done = flops_done = 0.0
            writer.write(step, metrics, prefix="train/")
            bar.set_postfix({"loss": f"{metrics['loss']:.4f}",
                             **{k: f"{metrics[k]:.3f}" for k in task.progress_keys if k in metrics}})
            last_t, last_step = now, step
            if is_main:
                for hook in hooks:
                    hook(StepInfo(step, metrics, state))
        bar.update(1)
        if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
            evaluate(step)
    bar.close()
    jax.block_until_ready(state)
    train_s = time.perf_counter() - t_start
    if checkpointer is not None:
        checkpointer.close()
    writer.close()
    history = writer.history("train/")
    return TrainResult(graphdef, state, history, evals, train_s, compile_s, start)


def _fingerprint(cfg: RunConfig, task: Task, extra_config: dict | None) -> dict:
    """The run's identity for resume checks (``checkpoint.run_fingerprint``): for a task other than the LM task,
    its name and the caller's config sections stand for ``data`` and ``objective``."""
    fp = ckpt_lib.run_fingerprint(cfg)
    if task.data_iter is None:  # not the LM dataset of cfg.data
        fp.update(objective=task.name, data=json.loads(json.dumps(extra_config or {}, default=str)))
    return fp


def _seq_len(batch: dict) -> int:
    tokens = batch.get("tokens")
    return int(tokens.shape[1]) if tokens is not None and tokens.ndim == 2 else 0


def _tokens(batch: dict) -> int:
    """Tokens per step for throughput: every position of the main ``tokens`` array (padding included, as MFU
    counts the compute), or 0 when the batch has none."""
    tokens = batch.get("tokens")
    return int(np.prod(tokens.shape)) if tokens is not None else 0


def _memory_summary(mem) -> str:
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    return ", ".join(f"{f.replace('_size_in_bytes', '')}={getattr(mem, f, 0) / 2**20:.1f} MiB" for f in fields)
