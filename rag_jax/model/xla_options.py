"""XLA compile options per kind of program (``jax.jit(compiler_options=...)``), chosen where a program is jitted.

XLA:CPU hands matmuls (and fusions around them) to YNNPACK by default. For matmuls over many rows its default is
slower than XLA's own dot emitter; for a few rows (decode, a short last block) it is faster. Measured (issue 28,
2-core Xeon, 2026-12-07; eight SwiGLU MLPs of SmolLM2's shape, f32, GFLOP/s default vs YNNPACK off): 4,096 rows
226 vs 255, 1,024 rows 221 vs 241, 512 rows 230 vs 234, 128 rows 186 vs 163, 1 row 14 vs 11; the whole
SmolLM2 prefill at 1K / 4K tokens 6-8% / 5% faster with it off, a 50-token Block-Attention last block 15%
slower. Train steps have their own setting (``rag_jax.train.step.CPU_TRAIN_COMPILER_OPTIONS``).
"""
from __future__ import annotations

import functools

import jax

LONG_FORWARD_ROWS = 512  # batch x tokens from which a forward-only program compiles with CPU_LONG_FORWARD_OPTIONS
CPU_LONG_FORWARD_OPTIONS = (("xla_cpu_experimental_ynn_fusion_type", ""),)


def forward_options(rows: int) -> tuple[tuple[str, str], ...]:
    """Compile options (hashable pairs; ``dict(...)`` of them for ``jax.jit``) for a forward-only program whose
    matmuls have ``rows`` rows (batch x tokens): :data:`CPU_LONG_FORWARD_OPTIONS` on the CPU backend from
    :data:`LONG_FORWARD_ROWS` rows, otherwise none (GPU / TPU keep their defaults)."""
    return CPU_LONG_FORWARD_OPTIONS if rows >= LONG_FORWARD_ROWS and jax.default_backend() == "cpu" else ()


def jit_by_options(fun, **jit_kwargs):
    """``options -> jax.jit(fun, compiler_options=dict(options) or None, **jit_kwargs)``, one jitted function per
    distinct ``options`` (``forward_options`` pairs), created on first use."""
    return functools.cache(lambda options: jax.jit(fun, compiler_options=dict(options) or None, **jit_kwargs))
