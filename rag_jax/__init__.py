"""rag-jax: retrieval-augmented and long-context language models in JAX / Flax NNX.

Importing the package selects XLA:CPU's memory-optimized scheduler (``--xla_cpu_scheduler_type``) unless
``XLA_FLAGS`` already chooses one. XLA:CPU's default scheduler gives the loop buffers of every layer's
blockwise attention their own memory: a 30-layer SmolLM2-135M prefill of 8,192 tokens needed 771 MB of
temporaries, 182 MB with this scheduler, at the same speed (issue 15). The flag is read when JAX's backend
starts: import ``rag_jax`` before the first JAX computation. It changes memory, never values.

On a machine with neither a TPU nor a GPU (JAX's own ``hardware_utils`` checks) and no ``JAX_PLATFORMS`` set,
JAX is told to use the CPU only: with libtpu installed (the ``tpu`` extra, for the TPU AOT-compile test, which
loads libtpu itself) JAX would otherwise start libtpu at every command, which prints "could not determine TPU
accelerator type ... unexpected worker hostname" errors on a CPU machine (issue 27).
"""
import os

_SCHEDULER = "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
if "xla_cpu_scheduler_type" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_SCHEDULER}".strip()


def _cpu_only_without_accelerators() -> None:
    if "JAX_PLATFORMS" in os.environ:
        return
    try:  # the checks JAX itself runs before warning about unused accelerators (private: absent -> leave JAX be)
        from jax._src import hardware_utils as hw
        accelerator = (hw.num_available_tpu_chips_and_device_id()[0] > 0 or hw.has_visible_nvidia_gpu()
                       or hw.num_available_amd_gpus(stop_at=1) > 0)
    except (ImportError, AttributeError, TypeError, OSError):
        return
    if not accelerator:
        import jax
        jax.config.update("jax_platforms", "cpu")


_cpu_only_without_accelerators()
