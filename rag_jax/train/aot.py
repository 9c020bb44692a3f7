"""Ahead-of-time compilation of the train step for a TPU topology on a CPU-only machine.

``jax.experimental.topologies.get_topology_desc`` describes TPU chips without having them (it needs
``libtpu``, from the ``jax[tpu]`` extra on PyPI); the train step is lowered on abstract inputs carrying
shardings over a mesh of those chips and compiled by the TPU compiler. ``compiled.memory_analysis()``
then gives the per-chip HBM the step needs: the check MaxText's ``train_compile`` does before a pod
run (research note jax_frameworks.md 1.1).
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from rag_jax import sharding
from rag_jax.model.config import apply_precision
from rag_jax.train import metrics, optim, step as step_lib
from rag_jax.train.checkpoint import abstract_with_shardings
from rag_jax.train.trainer import resolve_objective

GiB = 2**30
# HBM per chip and peak dense bf16 FLOP/s per chip (Cloud TPU system architecture pages).
HBM_BYTES = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB}
PEAK_BF16_FLOPS = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12}
# Slice names count TensorCores for v4/v5p (2 per chip, one JAX device per chip) and chips for v5e/v6e.
TOPOLOGY_ALIASES = {
    "v5p-8": "v5p:2x2x1", "v5p-16": "v5p:2x2x2", "v5p-32": "v5p:2x2x4", "v5p-64": "v5p:2x4x4",
    "v5p-128": "v5p:4x4x4", "v5p-256": "v5p:4x4x8", "v5p-512": "v5p:4x8x8", "v4-8": "v4:2x2x1", "v4-16": "v4:2x2x2", "v4-32": "v4:2x2x4",
    "v5e-4": "v5e:2x2", "v5e-8": "v5e:2x4", "v5e-16": "v5e:4x4", "v5e-64": "v5e:8x8", "v5e-256": "v5e:16x16",
    "v6e-4": "v6e:2x2", "v6e-8": "v6e:2x4", "v6e-16": "v6e:4x4", "v6e-256": "v6e:16x16",
}


class DoesNotFitError(RuntimeError):
    """The compiled step needs more HBM per chip than the chip has."""


def topology_devices(topology: str) -> tuple[str, list]:
    """``"v5p:2x2x2"`` or an alias (``"v5p-64"``) -> (generation, abstract TPU devices).

    Raises:
      ValueError: an unknown generation or a topology libtpu rejects.
      ImportError: libtpu is not installed (pip install "jax[tpu]").
    """
    from jax.experimental import topologies

    name = TOPOLOGY_ALIASES.get(topology, topology)
    generation = name.split(":")[0]
    if generation not in HBM_BYTES or ":" not in name:
        raise ValueError(f"topology {topology!r}: use <generation>:<shape> with generation in {sorted(HBM_BYTES)} "
                         f"(e.g. v5p:2x2x2, v5e:4x4) or one of {sorted(TOPOLOGY_ALIASES)}")
    try:
        import libtpu  # noqa: F401
    except ImportError as e:
        raise ImportError('TPU AOT compilation needs libtpu: pip install "jax[tpu]" (no TPU needed)') from e
    try:
        desc = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as e:  # libtpu raises XlaRuntimeError for shapes it does not know
        raise ValueError(f"libtpu cannot describe topology {name!r}: {e}") from e
    return generation, list(desc.devices)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-chip bytes of the compiled step (``compiled.memory_analysis()``) and its per-chip work.

    ``model_flops`` are the model's own FLOPs (``metrics.train_flops_per_token``), ``hardware_flops`` add what
    the remat policy recomputes (``metrics.recompute_flops_per_token``): the roofline step time is
    ``hardware_flops / peak`` (compute-bound; HBM traffic of a step this size takes far less) and the MFU it
    implies ``model_flops / hardware_flops``, an upper bound before communication and kernel efficiency.
    ``flops`` / ``bytes_accessed`` are XLA's ``cost_analysis``, reported as given: a lower bound, as XLA counts
    a while loop's body once (a scanned stack's layers, the compiler's own collective-matmul loops) and a
    Pallas kernel (splash attention) as zero."""

    topology: str
    num_chips: int
    arguments: int
    outputs: int
    temporaries: int
    aliased: int
    generated_code: int
    hbm: int
    compile_s: float = 0.0
    flops: float = 0.0           # per chip per step, XLA cost_analysis
    bytes_accessed: float = 0.0  # per chip per step, XLA cost_analysis
    model_flops: float = 0.0     # per chip per step: 6 N + causal attention per token
    hardware_flops: float = 0.0  # model_flops + remat recompute
    peak_flops: float = 0.0

    @property
    def total(self) -> int:
        """Peak estimate: live arguments + outputs + temporaries (donated outputs alias inputs) + code."""
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.generated_code

    @property
    def roofline_step_s(self) -> float:
        """Lower bound on the step time (seconds) at the chip's peak."""
        return self.hardware_flops / self.peak_flops if self.peak_flops else 0.0

    @property
    def roofline_mfu(self) -> float:
        """Model FLOPs utilization at the roofline step time (an upper bound on the MFU a run can reach)."""
        return self.model_flops / self.hardware_flops if self.hardware_flops else 0.0

    def table(self) -> str:
        rows = [("arguments (params, opt state, batch)", self.arguments), ("outputs", self.outputs),
                ("aliased (donated)", -self.aliased), ("temporaries (activations, grads)", self.temporaries),
                ("generated code", self.generated_code), ("total per chip", self.total), ("HBM per chip", self.hbm)]
        lines = [f"{self.topology}: {self.num_chips} chips"] + [f"  {k:<38} {v / GiB:9.2f} GiB" for k, v in rows]
        lines.append(f"  fits: {'yes' if self.total <= self.hbm else 'NO'} ({100 * self.total / self.hbm:.1f}% of HBM)")
        if self.model_flops:
            lines += [f"  compile {self.compile_s:.1f} s; per chip per step: {self.model_flops / 1e12:.1f} TFLOP model, "
                      f"{self.hardware_flops / 1e12:.1f} with remat; XLA cost_analysis {self.flops / 1e12:.1f} TFLOP, "
                      f"{self.bytes_accessed / GiB:.1f} GiB (loop bodies once, kernels 0)",
                      f"  roofline step {self.roofline_step_s:.2f} s, MFU at most {100 * self.roofline_mfu:.1f}%"]
        return "\n".join(lines)


def compile_train_step(run_cfg, mesh: Mesh):
    """Lower + compile the run's train step on abstract, sharded inputs over ``mesh`` (any devices)."""
    tc = run_cfg.train
    sharding.check_global_batch(tc.global_batch_size, mesh, run_cfg.rules, tc.grad_accum_steps)
    model_cfg = apply_precision(run_cfg.model, tc.precision)
    tx = optim.make_optimizer(run_cfg.optimizer, tc.steps)
    graphdef, abstract, specs = step_lib.abstract_train_state(model_cfg, tx, seed=tc.seed,
                                                              remat_policy=tc.remat_policy)
    shardings = step_lib.train_state_shardings(abstract, specs, tx, mesh, run_cfg.rules)
    train_step = step_lib.make_train_step(graphdef, tx, resolve_objective(tc.objective), shardings, mesh,
                                          accum_steps=tc.grad_accum_steps, seed=tc.seed, rules=run_cfg.rules,
                                          trainable=optim.trainable_mask(run_cfg.optimizer, abstract.params))
    batch_sharding = NamedSharding(mesh, sharding.logical_to_spec(("batch",), mesh, run_cfg.rules))
    shape = (tc.global_batch_size, run_cfg.data.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding)
             for k in ("tokens", "positions", "segment_ids")}
    return train_step.lower(abstract_with_shardings(abstract, shardings), batch).compile()


def _cost(compiled) -> tuple[float, float]:
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def aot_memory_report(run_cfg, topology: str, *, check_fit: bool = True) -> MemoryReport:
    """Compile ``run_cfg``'s train step for ``topology`` and report per-chip memory.

    Raises:
      DoesNotFitError: (check_fit) the step needs more than the chip's HBM, or the TPU compiler ran out of
        HBM; the message has the numbers.
      ValueError: bad topology, or a mesh/batch that does not match the chip count.
    """
    generation, devices = topology_devices(topology)
    mesh = sharding.make_mesh(run_cfg.mesh, devices)
    hbm = HBM_BYTES[generation]
    start = time.perf_counter()
    try:
        compiled = compile_train_step(run_cfg, mesh)
    except Exception as e:
        if "RESOURCE_EXHAUSTED" in str(e) or "Ran out of memory" in str(e):
            raise DoesNotFitError(f"{topology}: the train step does not fit in {hbm / GiB:.0f} GiB HBM per chip "
                                  f"(TPU compiler: {str(e)[:800]})") from e
        raise
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    flops, bytes_accessed = _cost(compiled)
    tc = run_cfg.train
    tokens = tc.global_batch_size * run_cfg.data.seq_len
    seq = run_cfg.data.seq_len
    model_flops = metrics.train_flops_per_token(run_cfg.model, seq) * tokens / len(devices)
    hardware_flops = model_flops + metrics.recompute_flops_per_token(run_cfg.model, seq, tc.remat_policy) * tokens / len(devices)
    report = MemoryReport(topology=topology, num_chips=len(devices), arguments=mem.argument_size_in_bytes,
                          outputs=mem.output_size_in_bytes, temporaries=mem.temp_size_in_bytes,
                          aliased=mem.alias_size_in_bytes, generated_code=mem.generated_code_size_in_bytes, hbm=hbm,
                          compile_s=compile_s, flops=flops, bytes_accessed=bytes_accessed, model_flops=model_flops,
                          hardware_flops=hardware_flops,
                          peak_flops=PEAK_BF16_FLOPS[generation])
    if check_fit and report.total > hbm:
        raise DoesNotFitError(f"the train step needs {report.total / GiB:.2f} GiB per chip but a {generation} chip "
                              f"has {hbm / GiB:.0f} GiB HBM:\n{report.table()}")
    return report
