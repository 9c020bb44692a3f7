"""Multi-process JAX start-up: `initialize` (every process) and `launch_local` (N processes on loopback).

On TPU pods and SLURM clusters `jax.distributed.initialize()` discovers the coordinator itself; the
RAG_JAX_* variables (or arguments) cover the cases it cannot, e.g. several CPU processes on one machine,
which is how the multi-host tests run (CPU collectives over gloo; see the research note
jax_frameworks.md section 2.3).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time

import jax

ENV_COORDINATOR = "RAG_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "RAG_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "RAG_JAX_PROCESS_ID"


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """Start `jax.distributed` for this process; call before any other JAX operation.

    Arguments default to the env vars RAG_JAX_COORDINATOR ("host:port"), RAG_JAX_NUM_PROCESSES and
    RAG_JAX_PROCESS_ID. A no-op when num_processes is None or 1, so single-process runs need nothing.
    On the CPU backend gloo collectives are selected first (cross-process all-reduce on CPU).

    Raises:
      ValueError: num_processes > 1 without a coordinator address or process id, or process_id out of
        range [0, num_processes).
    """
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if num_processes in (None, 1):
        return
    if num_processes < 1:
        raise ValueError(f"num_processes={num_processes} must be >= 1")
    if coordinator_address is None or process_id is None:
        raise ValueError(
            f"num_processes={num_processes} needs coordinator_address (got {coordinator_address!r}) and "
            f"process_id (got {process_id!r}); pass them or set {ENV_COORDINATOR} / {ENV_PROCESS_ID}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, {num_processes})")
    platforms = os.environ.get("JAX_PLATFORMS", "") or str(jax.config.jax_platforms or "")
    if platforms.split(",")[0] == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, n_chars: int = 3000) -> str:
    with open(path, "rb") as f:
        data = f.read()
    return data[-n_chars:].decode("utf-8", errors="replace")


def launch_local(argv: list[str], num_processes: int, devices_per_process: int, timeout_s: float,
                 env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Run `num_processes` copies of `argv` as one JAX job on 127.0.0.1 (CPU, gloo) and wait for all.

    Each child gets RAG_JAX_COORDINATOR/NUM_PROCESSES/PROCESS_ID, JAX_PLATFORMS=cpu and
    XLA_FLAGS=--xla_force_host_platform_device_count=<devices_per_process> on top of os.environ and `env`;
    the child must call `initialize()` itself. Children run in their own process groups and are always
    killed on return (success, failure, timeout or an exception here).

    Returns:
      one CompletedProcess per process (stdout/stderr as str), in process-id order.
    Raises:
      ValueError: num_processes or devices_per_process < 1, or timeout_s <= 0.
      RuntimeError: a process exited non-zero or the job exceeded timeout_s; the message holds each
        process's return code and stderr tail.
    """
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError(f"num_processes={num_processes} and devices_per_process={devices_per_process} "
                         "must both be >= 1")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0")
    port = _free_port()
    base_env = dict(os.environ)
    base_env.update(env or {})
    xla_flags = " ".join(f for f in base_env.get("XLA_FLAGS", "").split()
                         if not f.startswith("--xla_force_host_platform_device_count"))
    base_env["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={devices_per_process}".strip()
    base_env["JAX_PLATFORMS"] = "cpu"
    base_env[ENV_COORDINATOR] = f"127.0.0.1:{port}"
    base_env[ENV_NUM_PROCESSES] = str(num_processes)

    with tempfile.TemporaryDirectory(prefix="rag_jax_launch_") as logdir:
        procs, logs = [], []
        try:
            for pid in range(num_processes):
                out_path, err_path = f"{logdir}/{pid}.out", f"{logdir}/{pid}.err"
                logs.append((out_path, err_path))
                child_env = dict(base_env, **{ENV_PROCESS_ID: str(pid)})
                with open(out_path, "wb") as out, open(err_path, "wb") as err:
                    procs.append(subprocess.Popen(argv, env=child_env, stdout=out, stderr=err,
                                                  start_new_session=True))
            deadline = time.monotonic() + timeout_s
            timed_out = False
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                # Stop early when one process failed: its peers would block in a collective until the timeout.
                if any(c not in (None, 0) for c in codes):
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            for p in procs:
                p.wait()
        results = [subprocess.CompletedProcess(argv, p.returncode, _tail(o, 10**7), _tail(e, 10**7))
                   for p, (o, e) in zip(procs, logs)]
    if timed_out or any(r.returncode != 0 for r in results):
        why = f"timed out after {timeout_s} s" if timed_out else "a process failed"
        details = "\n".join(f"--- process {i} (rc={r.returncode}) stderr tail:\n{r.stderr[-3000:]}"
                            for i, r in enumerate(results))
        raise RuntimeError(f"launch_local: {why}; argv={argv}\n{details}")
    return results
