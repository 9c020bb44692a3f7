"""rag_jax.distributed: 2 CPU processes on loopback form one JAX job; failures and timeouts clean up."""
import sys
import time

import pytest

from rag_jax import distributed

# Each process contributes (process_id + 1) * [1, 2] on its 2 local devices; the global sum over
# 2 processes x 2 devices is computed by a cross-process all-reduce (gloo).
WORKER = r"""
import numpy as np
from rag_jax import distributed
distributed.initialize()
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
pid = jax.process_index()
local = (pid + 1) * np.arange(1, jax.local_device_count() + 1, dtype=np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local, (jax.device_count(),))
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
print(f"RESULT {jax.process_count()} {jax.device_count()} {float(total)}")
"""


def test_two_processes_all_reduce():
    results = distributed.launch_local([sys.executable, "-c", WORKER], num_processes=2,
                                       devices_per_process=2, timeout_s=120)
    lines = [next(l for l in r.stdout.splitlines() if l.startswith("RESULT")) for r in results]
    # (1+2) from process 0 plus 2*(1+2) from process 1.
    assert lines == ["RESULT 2 4 9.0"] * 2


def test_failure_raises_with_stderr_and_kills_peers():
    code = ("import os, sys, time\n"
            "if os.environ['RAG_JAX_PROCESS_ID'] == '1': sys.exit('worker 1 broke')\n"
            "time.sleep(60)\n")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker 1 broke"):
        distributed.launch_local([sys.executable, "-c", code], 2, 1, timeout_s=60)
    assert time.monotonic() - start < 30  # the sleeping peer was killed, not waited for


def test_timeout_kills_children():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        distributed.launch_local([sys.executable, "-c", "import time; time.sleep(60)"], 2, 1, timeout_s=2)
    assert time.monotonic() - start < 20


def test_initialize_validates_arguments(monkeypatch):
    for var in ("RAG_JAX_COORDINATOR", "RAG_JAX_NUM_PROCESSES", "RAG_JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    distributed.initialize()  # single process: a no-op
    with pytest.raises(ValueError, match="coordinator_address"):
        distributed.initialize(num_processes=2, process_id=0)
    with pytest.raises(ValueError, match="process_id=3"):
        distributed.initialize("127.0.0.1:1", num_processes=2, process_id=3)
    monkeypatch.setenv("RAG_JAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="RAG_JAX_NUM_PROCESSES"):
        distributed.initialize()
