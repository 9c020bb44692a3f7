"""Shared pytest setup: 8 fake CPU devices for sharding tests and a fast-compiling XLA (set before JAX starts)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# Tests compile far more than they run: LLVM's optimization level 0 halves XLA:CPU compile time on the toy models
# (test_grit_model.py 106 -> 73 s) and leaves SmolLM2-sized runs as fast (matmuls are library calls).
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gc  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path to ../shared/data; tests using it skip with a reason when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder {SHARED_DATA} is absent (only present in the project's workspace)")
    return SHARED_DATA


def _memory_maps() -> int | None:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. XLA:CPU maps each executable's code into its own
    memory regions (about 4 per program); a whole-suite process that keeps them all reaches the kernel's
    ``vm.max_map_count`` (65530) and LLVM segfaults in the next compile (seen at test 836 of 911). After
    clearing, the count must stay under half the limit, so a leak fails here, named, instead of crashing later."""
    yield
    jax.clear_caches()
    gc.collect()
    maps = _memory_maps()
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return
    if maps is not None and maps > limit // 2:
        pytest.fail(f"{maps} memory maps after clearing JAX's caches, over half of vm.max_map_count {limit}: "
                    "something keeps compiled programs alive")
