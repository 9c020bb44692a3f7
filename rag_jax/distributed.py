"""Multi-process JAX start-up: `initialize` (every process) and `launch_local` (N processes on loopback).

On TPU pods and SLURM clusters `jax.distributed.initialize()` discovers the coordinator itself; the
RAG_JAX_* variables (or arguments) cover the cases it cannot, e.g. several CPU processes on one machine,
which is how the multi-host tests run (CPU collectives over gloo; see the research note
jax_frameworks.md section 2.3).

Failing fast when a peer dies: left alone, a survivor's failed collective is followed by JAX's exit-time
shutdown barrier, which waits for the dead peer until the coordination service's heartbeat timeout
(~100 s), then aborts with a C++ stack dump. ``initialize`` therefore starts a ``PeerWatchdog`` thread:
every ``interval`` seconds each process bumps its counter under ``rag_jax/heartbeat/<id>`` in the
coordination service's key-value store and reads everyone's. A peer whose counter has not moved for
``RAG_JAX_PEER_TIMEOUT_S`` seconds (default 10), or a coordinator that stops answering, ends the process
with one line (``rag_jax.distributed: process 0 lost process 1 (no heartbeat for 10 s); exiting``) and
exit code 1. A process that exits normally marks itself ``exit`` first, so it is not reported.

When process 0 itself dies, the coordination service (which lives in process 0) goes with it and JAX
ends every survivor within a second, before this watchdog or any other Python code can run: the gRPC
thread of JAX's coordination-service agent gets "connection reset", and the runtime client's default
``missed_heartbeat_callback`` logs ``Terminating process because the JAX distributed service detected
fatal errors ... the leader task was preempted/died`` at FATAL level and aborts (SIGABRT, with a C++ stack
trace). ``jax.distributed.initialize`` does not expose that callback, and a Python callback injected
into ``jax._src.lib._jax.get_distributed_runtime_client`` cannot receive its ``absl::Status`` argument
in jaxlib 0.10.2 (the process dies with ``std::bad_cast``), so the survivors' message is JAX's own;
they still exit non-zero at once (tests/test_reliability.py).
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import jax

ENV_COORDINATOR = "RAG_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "RAG_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "RAG_JAX_PROCESS_ID"
ENV_PEER_TIMEOUT = "RAG_JAX_PEER_TIMEOUT_S"
HEARTBEAT_DIR = "rag_jax/heartbeat/"


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
    _start(coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id)


def initialize_from_cluster() -> None:
    """``jax.distributed.initialize()`` with everything read from the cluster (Cloud TPU pods, SLURM: the
    coordinator is the first node of ``SLURM_STEP_NODELIST``, the process id ``SLURM_PROCID``), with the same
    CPU collectives and peer watchdog as ``initialize``. Call before any other JAX operation."""
    _start()


def _start(**kwargs) -> None:
    platforms = os.environ.get("JAX_PLATFORMS", "") or str(jax.config.jax_platforms or "")
    if platforms.split(",")[0] == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeout_s = _env_float(ENV_PEER_TIMEOUT, 10.0)
    jax.distributed.initialize(**kwargs)
    from jax._src import distributed as jax_distributed  # the coordination-service client (no public handle)
    state = jax_distributed.global_state
    process_id, num_processes = state.process_id, state.num_processes
    client = getattr(state, "client", None)
    if all(hasattr(client, m) for m in ("key_value_set", "key_value_dir_get")):
        PeerWatchdog(client, process_id, num_processes, timeout_s).start()
    else:  # a JAX without this client API: peers fail at JAX's own heartbeat timeout instead
        logging.getLogger(__name__).warning("no coordination-service client; the peer watchdog is off")


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"environment variable {name}={raw!r} must be a positive number of seconds")
    return value


class PeerWatchdog(threading.Thread):
    """Heartbeats through the coordination service's key-value store; ends this process (one stderr
    line, exit code 1) when a peer's heartbeat stalls for ``timeout_s`` or the coordinator is gone.

    Args:
      client: ``jax._src.distributed.global_state.client`` (key_value_set / key_value_dir_get).
      process_id, num_processes: this process and the job size.
      timeout_s: seconds without a heartbeat change before a peer counts as lost.
      exit_fn: called with the message instead of printing and ``os._exit(1)`` (tests).
    """

    def __init__(self, client, process_id: int, num_processes: int, timeout_s: float, exit_fn=None):
        super().__init__(name="rag_jax-peer-watchdog", daemon=True)
        self.client, self.me, self.n, self.timeout_s = client, process_id, num_processes, timeout_s
        self.interval = min(1.0, timeout_s / 5)
        self.exit_fn = exit_fn or _exit_with
        self._exiting = False
        atexit.register(self._mark_exit)

    def _mark_exit(self) -> None:
        self._exiting = True
        try:
            self.client.key_value_set(f"{HEARTBEAT_DIR}{self.me}", "exit", allow_overwrite=True)
        except Exception:
            pass

    def run(self) -> None:
        start = time.monotonic()
        seen: dict[int, tuple[str, float]] = {}
        last_ok, beat = start, 0
        while True:
            beat += 1
            now = time.monotonic()
            try:
                if not self._exiting:
                    self.client.key_value_set(f"{HEARTBEAT_DIR}{self.me}", str(beat), allow_overwrite=True)
                values = {k.rsplit("/", 1)[-1]: v for k, v in self.client.key_value_dir_get(HEARTBEAT_DIR)}
                last_ok = now
            except Exception as e:  # the coordinator (in process 0) is unreachable
                if self.me != 0 and now - last_ok > self.timeout_s:
                    reason = " ".join(str(e).split())[:160]
                    return self.exit_fn(f"process {self.me} lost the coordinator (process 0) for "
                                        f"{now - last_ok:.0f} s ({reason})")
                time.sleep(self.interval)
                continue
            for peer in range(self.n):
                if peer == self.me:
                    continue
                value = values.get(str(peer))
                if value == "exit":
                    continue
                if peer not in seen or seen[peer][0] != value:
                    seen[peer] = (value, now)
                elif now - seen[peer][1] > self.timeout_s and (value is not None or now - start > 6 * self.timeout_s):
                    return self.exit_fn(f"process {self.me} lost process {peer} (no heartbeat for "
                                        f"{now - seen[peer][1]:.0f} s)")
            time.sleep(self.interval)


def _exit_with(message: str) -> None:
    sys.stderr.flush()
    os.write(2, f"rag_jax.distributed: {message}; exiting\n".encode())
    os._exit(1)


_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# Runs `argv[2:]` after asking the kernel to SIGKILL it when the launcher (pid argv[1]) dies
# (Linux prctl PR_SET_PDEATHSIG = 1; kept across exec). A wrapper, not preexec_fn: preexec_fn runs Python
# in the forked child of a multithreaded (JAX) parent, which can deadlock.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n")


def _kill_groups(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


class _forward_signals:
    """While alive: SIGTERM/SIGINT/SIGHUP to this process go to every child's process group (a grace of
    5 s, then SIGKILL), after which the previous handler runs (default: this process ends)."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs, self.previous = procs, {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in _FORWARDED}

    def _handle(self, sig, frame) -> None:
        _kill_groups(self.procs, sig)
        deadline = time.monotonic() + 5.0
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        _kill_groups(self.procs, signal.SIGKILL)
        previous = self.previous.get(sig)
        self.restore()
        if callable(previous):
            previous(sig, frame)
        else:
            signal.raise_signal(sig)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


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
    killed on return (success, failure, timeout or an exception here). SIGTERM/SIGINT/SIGHUP sent to this
    process are forwarded to every child's group (then the children are killed and the signal's usual
    exit follows); if this process is killed outright (SIGKILL), the kernel kills the children
    (``PR_SET_PDEATHSIG``, Linux), so no child outlives the launcher.

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
        forward = _forward_signals(procs)
        try:
            for pid in range(num_processes):
                out_path, err_path = f"{logdir}/{pid}.out", f"{logdir}/{pid}.err"
                logs.append((out_path, err_path))
                child_env = dict(base_env, **{ENV_PROCESS_ID: str(pid)})
                with open(out_path, "wb") as out, open(err_path, "wb") as err:
                    procs.append(subprocess.Popen([sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv],
                                                  env=child_env, stdout=out, stderr=err, start_new_session=True))
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
            _kill_groups(procs, signal.SIGKILL)
            for p in procs:
                p.wait()
            forward.restore()
        results = [subprocess.CompletedProcess(argv, p.returncode, _tail(o, 10**7), _tail(e, 10**7))
                   for p, (o, e) in zip(procs, logs)]
    if timed_out or any(r.returncode != 0 for r in results):
        why = f"timed out after {timeout_s} s" if timed_out else "a process failed"
        details = "\n".join(f"--- process {i} (rc={r.returncode}) stderr tail:\n{r.stderr[-3000:]}"
                            for i, r in enumerate(results))
        raise RuntimeError(f"launch_local: {why}; argv={argv}\n{details}")
    return results
