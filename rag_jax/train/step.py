"""Functional train state and the jitted, sharded train step.

The model is split once (``nnx.split``) into a static graph definition and a parameter pytree; the step
is a pure function over ``TrainState`` jitted with explicit ``in_shardings``/``out_shardings`` (from
the logical rules in ``rag_jax.sharding``) and the state donated, so params, gradients and optimizer
state stay in their shardings and the old buffers are reused (research note jax_frameworks.md 2.4, 6.4).
"""
from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rag_jax import sharding
from rag_jax.model import ModelConfig, Transformer
from rag_jax.model.transformer import relayout_params

LossFn = Callable[[Any, dict, jax.Array], tuple[jax.Array, dict]]

# XLA:CPU compiles the train step with XNNPACK fusing dots only (its elementwise and reduce fusions stay XLA's
# own loops): the backward's elementwise fusions (RoPE, SwiGLU, the loss's softmax sums) ran 2-5x slower as
# XNNPACK fusions. Issue 28, same process, 2 pinned cores, SmolLM2-width 8 layers, 4 x 1,024 tokens, AdamW:
# 10.07 vs 10.97 s per step (one more pair of separate processes: 9.2-9.8 vs 10.8-10.9 s). Forward-only
# programs keep XLA's default, which is faster for them (prefill 1K: 999 vs 949 tokens/s).
CPU_TRAIN_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}


def compiler_options(mesh: Mesh) -> dict | None:
    """``jax.jit(compiler_options=...)`` for a train step on ``mesh``: :data:`CPU_TRAIN_COMPILER_OPTIONS` when
    its devices are CPUs, else None (GPU / TPU, and TPU AOT compiles from a CPU host, keep their defaults)."""
    return dict(CPU_TRAIN_COMPILER_OPTIONS) if mesh.devices.flat[0].platform == "cpu" else None


@flax.struct.dataclass
class TrainState:
    """step: int32 scalar (optimizer steps done); params: nnx.State of the model; opt_state: optax state."""

    step: jax.Array
    params: Any
    opt_state: Any


def _build(cfg: ModelConfig, seed: int, remat_policy: str):
    return Transformer(cfg, rngs=nnx.Rngs(seed), remat_policy=remat_policy)


def abstract_train_state(cfg: ModelConfig, tx: optax.GradientTransformation, *, seed: int = 0,
                         remat_policy: str = "none"):
    """``(graphdef, TrainState of ShapeDtypeStruct, logical PartitionSpecs of params)``; allocates nothing."""
    abstract_model = nnx.eval_shape(lambda: _build(cfg, seed, remat_policy))
    graphdef, params = nnx.split(abstract_model)
    opt_state = jax.eval_shape(tx.init, params)
    state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params, opt_state=opt_state)
    return graphdef, state, nnx.get_partition_spec(params)


def train_state_shardings(abstract_state: TrainState, param_specs, tx: optax.GradientTransformation, mesh: Mesh,
                          rules: sharding.Rules = sharding.DEFAULT_RULES) -> TrainState:
    """NamedShardings for every leaf: params by their logical names, optimizer moments like their param,
    scalars (step, Adam count) replicated (also required for multi-host checkpoints)."""
    replicated = NamedSharding(mesh, P())
    params = sharding.tree_shardings(abstract_state.params, param_specs, mesh, rules)
    opt_state = optax.tree_map_params(tx, lambda _, s: s, abstract_state.opt_state, params,
                                      transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=params, opt_state=opt_state)


def init_train_state(cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh, *, seed: int = 0,
                     remat_policy: str = "none", rules: sharding.Rules = sharding.DEFAULT_RULES,
                     params: nnx.State | None = None):
    """Create params and optimizer state directly in their shardings (no host-side full copy).

    Args:
      params: start from these parameters (e.g. a pretrained model's ``nnx.split(model)[1]``, matching ``cfg``
        up to the layer layout: unrolled parameters are stacked for ``cfg.scan_layers`` and vice versa) instead of
        a random initialization; they are resharded into the train state's layout.

    Returns:
      ``(graphdef, TrainState, shardings: TrainState of NamedSharding)``.
    """
    graphdef, abstract, specs = abstract_train_state(cfg, tx, seed=seed, remat_policy=remat_policy)
    shardings = train_state_shardings(abstract, specs, tx, mesh, rules)

    if params is not None:  # a pretrained model's parameters in either layer layout (ModelConfig.scan_layers)
        values = relayout_params(nnx.to_pure_dict(params), cfg.num_layers, cfg.scan_layers)
        params = jax.tree.map(lambda x: x, abstract.params)
        nnx.replace_by_pure_dict(params, values)

    def init(start):
        if start is None:
            _, start = nnx.split(_build(cfg, seed, remat_policy))
        start = jax.tree.map(lambda a, b: b.astype(a.dtype), abstract.params, start)
        return TrainState(step=jnp.zeros((), jnp.int32), params=start, opt_state=tx.init(start))

    state = jax.jit(init, out_shardings=shardings)(params)
    return graphdef, state, shardings


def _weighted_grads(loss_and_grad, params, batch, rng, accum_steps: int, micro_sharding):
    """Gradient over ``accum_steps`` micro-batches, weighted by ``metrics["num_tokens"]`` when present,
    so the result equals the full-batch gradient of a token-mean loss.

    Micro-batch i takes rows ``i, i+accum, ...`` of the global batch: every data-parallel shard holds an
    equal part of every micro-batch, so no rows move between devices.
    """
    if accum_steps == 1:
        (loss, metrics), grads = loss_and_grad(params, batch, rng)
        return grads, {"loss": loss, **metrics}

    def split(x):
        x = x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, micro_sharding)

    micro = jax.tree.map(split, batch)

    def body(carry, inputs):
        grad_sum, metric_sum, weight_sum = carry
        mb, i = inputs
        (loss, metrics), grads = loss_and_grad(params, mb, jax.random.fold_in(rng, i))
        metrics = {"loss": loss, **metrics}
        w = metrics.get("num_tokens", jnp.float32(1.0)).astype(jnp.float32)
        grad_sum = jax.tree.map(lambda a, g: a + w * g.astype(jnp.float32), grad_sum, grads)
        metric_sum = {k: metric_sum[k] + (v if k == "num_tokens" else w * v) for k, v in metrics.items()}
        return (grad_sum, metric_sum, weight_sum + w), None

    zeros_g = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    first_metrics = jax.eval_shape(lambda: loss_and_grad(params, jax.tree.map(lambda x: x[0], micro), rng)[0])
    zeros_m = {"loss": jnp.float32(0.0), **{k: jnp.float32(0.0) for k in first_metrics[1]}}
    (grad_sum, metric_sum, weight_sum), _ = jax.lax.scan(
        body, (zeros_g, zeros_m, jnp.float32(0.0)), (micro, jnp.arange(accum_steps)))
    denom = jnp.maximum(weight_sum, 1e-9)
    grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grad_sum, params)
    metrics = {k: v if k == "num_tokens" else v / denom for k, v in metric_sum.items()}
    return grads, metrics


def make_train_step(graphdef, tx: optax.GradientTransformation, loss_fn: LossFn, shardings: TrainState, mesh: Mesh,
                    *, accum_steps: int = 1, seed: int = 0, rules: sharding.Rules = sharding.DEFAULT_RULES,
                    learning_rate_fn: Callable | None = None, trainable: Any = None):
    """Jitted ``step(state, batch) -> (state, metrics)``.

    Args:
      graphdef: from ``init_train_state``.
      loss_fn: ``loss_fn(model, batch, rng) -> (loss, metrics)`` (rag_jax/train/objectives).
      shardings: TrainState of NamedShardings (``init_train_state``); batch arrays are sharded on their
        leading axis over the data-parallel mesh axes.
      accum_steps: gradient accumulation micro-batches per step (the global batch must be a multiple
        of data-parallel size x accum_steps).
      seed: base of the per-step PRNG key ``fold_in(key(seed), step)`` handed to loss_fn.
      learning_rate_fn: optional schedule, logged as ``metrics["learning_rate"]``.
      trainable: optional pytree of Python bools like the params (``optim.trainable_mask``): the others enter
        the loss through ``jax.lax.stop_gradient``, so their gradients are zeros and no backward pass runs
        below the lowest trainable parameter (pair it with the optimizer of the same mask, which freezes them).

    Returns:
      the jitted step; state is donated. Metrics (float32 scalars, replicated): loss_fn's metrics plus
      ``loss``, ``grad_norm`` (before clipping) and ``learning_rate`` (if given).
    """
    if accum_steps < 1:
        raise ValueError(f"grad_accum_steps={accum_steps} must be >= 1")
    batch_spec = sharding.logical_to_spec(("batch",), mesh, rules)
    batch_sharding = NamedSharding(mesh, batch_spec)
    micro_sharding = NamedSharding(mesh, P(None, *batch_spec))
    replicated = NamedSharding(mesh, P())

    def loss_of(params, batch, rng):
        if trainable is not None:
            params = jax.tree.map(lambda p, t: p if t else jax.lax.stop_gradient(p), params, trainable)
        return loss_fn(nnx.merge(graphdef, params), batch, rng)

    loss_and_grad = jax.value_and_grad(loss_of, has_aux=True)

    def step(state: TrainState, batch: dict):
        rng = jax.random.fold_in(jax.random.key(seed), state.step)
        with sharding.activation_rules(mesh, rules):  # traced here: activation hints resolve on this mesh
            grads, metrics = _weighted_grads(loss_and_grad, state.params, batch, rng, accum_steps, micro_sharding)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        metrics["grad_norm"] = optax.tree.norm(grads).astype(jnp.float32)
        if learning_rate_fn is not None:
            metrics["learning_rate"] = jnp.asarray(learning_rate_fn(state.step), jnp.float32)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return jax.jit(step, in_shardings=(shardings, batch_sharding), out_shardings=(shardings, replicated),
                   donate_argnums=(0,), compiler_options=compiler_options(mesh))


def make_eval_step(graphdef, loss_fn: LossFn, shardings: TrainState, mesh: Mesh,
                   rules: sharding.Rules = sharding.DEFAULT_RULES):
    """Jitted ``eval_step(params, batch) -> metrics`` (loss_fn's metrics plus ``loss``; rng fixed at 0)."""
    batch_sharding = NamedSharding(mesh, sharding.logical_to_spec(("batch",), mesh, rules))

    def evaluate(params, batch):
        with sharding.activation_rules(mesh, rules):
            loss, metrics = loss_fn(nnx.merge(graphdef, params), batch, jax.random.key(0))
        return {k: jnp.asarray(v, jnp.float32) for k, v in {"loss": loss, **metrics}.items()}

    return jax.jit(evaluate, in_shardings=(shardings.params, batch_sharding),
                   out_shardings=NamedSharding(mesh, P()))
