"""``rag_jax.evaluation.timing``: thread flags and clocks of the benchmarks."""
import time

import pytest

from rag_jax.evaluation import timing


def test_cpu_threads_pins_cores_and_sets_flags(monkeypatch):
    pinned = {}
    monkeypatch.setattr(timing.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(timing.os, "sched_setaffinity", lambda tid, cores: pinned.__setitem__(tid, list(cores)))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
    assert timing.cpu_threads(0) is None and not pinned
    assert timing.os.environ["XLA_FLAGS"] == "--xla_dump_to=/nowhere"
    assert timing.cpu_threads(1) == [0]
    assert timing.os.environ["XLA_FLAGS"] == ("--xla_dump_to=/nowhere --xla_cpu_multi_thread_eigen=false "
                                              "intra_op_parallelism_threads=1")
    assert pinned and all(cores == [0] for cores in pinned.values())  # every thread of this process
    monkeypatch.delenv("XLA_FLAGS")
    assert timing.cpu_threads(2) == [0, 1]
    assert timing.os.environ["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads=2"
    assert timing.os.environ["OMP_NUM_THREADS"] == "2" and set(map(tuple, pinned.values())) == {(0, 1)}
    with pytest.raises(ValueError, match="4 cores"):
        timing.cpu_threads(8)


def test_clock_fn_and_median_on_cpu_clock():
    assert timing.clock_fn("wall") is time.perf_counter and timing.clock_fn("cpu") is time.process_time
    with pytest.raises(KeyError):
        timing.clock_fn("gpu")
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 3.0])  # three runs of 500, 250 and 1000 ms
    assert timing.median_ms(lambda: None, 3, warmup=0, clock=lambda: next(ticks)) == 500.0
