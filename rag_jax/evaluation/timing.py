"""One way to time things: medians of repeated wall-clock runs after warm-up, and a stage timer.

Every benchmark and evaluation that reports a time uses these (medians, never means: a busy 2-core
machine adds outliers).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(fn: Callable[[], object], repeats: int, *, warmup: int = 1,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``repeats`` runs, after ``warmup`` untimed runs
    (compilation, caches). ``fn`` must block until its result is ready (``jax.block_until_ready``).
    ``clock``: seconds; ``time.process_time`` measures CPU time instead (a busy machine does not inflate it).

    Raises:
      ValueError: ``repeats`` < 1 or ``warmup`` < 0.
    """
    return statistics.median(times_ms(fn, repeats, warmup=warmup, clock=clock))


def times_ms(fn: Callable[[], object], repeats: int, *, warmup: int = 1,
             clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Times of ``repeats`` runs of ``fn()`` in milliseconds on ``clock``, after ``warmup`` untimed runs."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        out.append((clock() - t0) * 1e3)
    return out


class StageTimer:
    """Wall and CPU seconds per named stage of a job (CPU time is what a busy machine does not inflate).

    ``timer.stage("train")`` closes the stage that started at the previous call (or construction);
    ``wall`` / ``cpu`` map stage names to seconds; ``total()`` is ``(wall s, CPU s)`` since construction.
    """

    def __init__(self):
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._t0 = self._last = time.perf_counter()
        self._c0 = self._last_cpu = time.process_time()

    def stage(self, name: str) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        self.wall[name], self.cpu[name] = now - self._last, cpu - self._last_cpu
        self._last, self._last_cpu = now, cpu

    def total(self) -> tuple[float, float]:
        return time.perf_counter() - self._t0, time.process_time() - self._c0
