"""``rag_jax.evaluation.timing``: thread flags and clocks of the benchmarks."""
import time

import pytest

from rag_jax.evaluation import timing


def test_cpu_threads_sets_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
    timing.cpu_threads(0)
    assert timing.os.environ["XLA_FLAGS"] == "--xla_dump_to=/nowhere"
    timing.cpu_threads(1)
    assert timing.os.environ["XLA_FLAGS"] == ("--xla_dump_to=/nowhere --xla_cpu_multi_thread_eigen=false "
                                              "intra_op_parallelism_threads=1")
    monkeypatch.delenv("XLA_FLAGS")
    timing.cpu_threads(4)
    assert timing.os.environ["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads=4"


def test_clock_fn_and_median_on_cpu_clock():
    assert timing.clock_fn("wall") is time.perf_counter and timing.clock_fn("cpu") is time.process_time
    with pytest.raises(KeyError):
        timing.clock_fn("gpu")
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 3.0])  # three runs of 500, 250 and 1000 ms
    assert timing.median_ms(lambda: None, 3, warmup=0, clock=lambda: next(ticks)) == 500.0
