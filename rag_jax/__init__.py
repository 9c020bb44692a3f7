"""rag-jax: retrieval-augmented and long-context language models in JAX / Flax NNX.

Importing the package selects XLA:CPU's memory-optimized scheduler (``--xla_cpu_scheduler_type``) unless
``XLA_FLAGS`` already chooses one. XLA:CPU's default scheduler gives the loop buffers of every layer's
blockwise attention their own memory: a 30-layer SmolLM2-135M prefill of 8,192 tokens needed 771 MB of
temporaries, 182 MB with this scheduler, at the same speed (issue 15). The flag is read when JAX's backend
starts: import ``rag_jax`` before the first JAX computation. It changes memory, never values.
"""
import os

_SCHEDULER = "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
if "xla_cpu_scheduler_type" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_SCHEDULER}".strip()
