"""One way to time things: medians of repeated wall-clock runs after warm-up, and a stage timer.

Every benchmark and evaluation that reports a time uses these (medians, never means: a busy 2-core
machine adds outliers).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable


def cpu_threads(n: int) -> list[int] | None:
    """Bind this process to ``n`` cores (0: leave everything as it is) and size the thread pools to them.

    XLA:CPU ignores its thread flags on this jaxlib, so the binding is CPU affinity
    (``os.sched_setaffinity``, as ``taskset``): the first ``n`` cores this process may run on, set for
    every thread that exists now and inherited by every thread started later (XLA's and torch's pools
    size themselves from it). torch, if imported, gets ``torch.set_num_threads(n)``; ``OMP_NUM_THREADS``
    / ``MKL_NUM_THREADS`` are set for a torch imported later. The old XLA flags stay (harmless where
    ignored). Call before the first JAX computation; two processes that call it with the same ``n``
    run on the same cores, which is what a same-run comparison needs. Returns the cores (None for 0).

    Raises:
      ValueError: ``n`` larger than the cores this process may use.
    """
    if not n:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if n > len(allowed):
        raise ValueError(f"threads={n} but this process may run on {len(allowed)} cores {allowed}")
    cores = allowed[:n]
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen="
                               f"{'false' if n == 1 else 'true'} intra_op_parallelism_threads={n}").strip()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    return cores


def clock_fn(name: str) -> Callable[[], float]:
    """``"wall"`` -> ``time.perf_counter``; ``"cpu"`` -> ``time.process_time`` (CPU seconds of this process,
    all threads: what a shared, oversubscribed machine does not inflate)."""
    return {"wall": time.perf_counter, "cpu": time.process_time}[name]


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
