"""The fused CPU kernels through ``jax.ffi``, built on first use: attention forward and backward
(``cpu_attention.cc``), the vocab head's softmax cross-entropy gradient (``cpu_xent.cc``) and MagicPIG's decode
attention over bucket tables (``cpu_lsh.cc``).

``blockwise`` calls ``flash_forward`` / ``flash_backward`` for its two passes on the CPU backend when the kernels are
available: the C++ sources are compiled once per machine with the system's C++ compiler (``$CXX``, else ``g++`` /
``c++`` / ``clang++``; ``-O3 -march=native``) into ``$RAG_JAX_CACHE`` (default ``~/.cache/rag_jax``), the file
named by the hash of the sources, the flags, the compiler's version and the CPU's model and flags, written
atomically, then registered as XLA FFI targets. Without a compiler, or when the build fails, or with
``RAG_JAX_CPU_KERNEL=0``, ``available()`` is False and the pure-JAX tile loops run (same values to float32
rounding). The kernels' design is in the source: the forward runs one task per batch row, KV head and 64-query
block over all cores, the mask predicate of ``masks.py`` on each 128-key tile unless a range test proves it
empty or full, the online softmax in registers; the backward one task per batch row, KV head and 128-key block,
its dK / dV in the task's buffers, dQ in one buffer per thread.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

SOURCES = tuple(Path(__file__).with_name(n) for n in ("cpu_attention.cc", "cpu_xent.cc", "cpu_lsh.cc"))
HEADERS = (Path(__file__).with_name("cpu_simd.h"),)
TARGET = "rag_jax_flash_forward"
BWD_TARGET = "rag_jax_flash_backward"
XENT_TARGET = "rag_jax_softmax_xent"
LSH_TARGET = "rag_jax_lsh_attend"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread")
MODES = {"causal": 0, "bidirectional": 1, "block": 2}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(keep)
    except OSError:
        return platform.processor() or platform.machine()


def _build(cxx: str) -> Path:
    """The shared library for these sources, flags, compiler and CPU (compiled when not cached)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([*(f.read_text() for f in SOURCES + HEADERS), " ".join(FLAGS), version, _cpu_id(),
                                    jax.ffi.include_dir()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("RAG_JAX_CACHE", Path.home() / ".cache" / "rag_jax"))
    lib = cache / f"cpu_kernels_{key}.so"
    if lib.is_file():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        out = Path(tmp) / lib.name
        subprocess.run([cxx, *FLAGS, "-I", jax.ffi.include_dir(), *map(str, SOURCES), "-o", str(out)],
                       capture_output=True, text=True, check=True)
        os.replace(out, lib)                 # atomic: a concurrent builder writes the same file
    return lib


@functools.cache
def available() -> bool:
    """Whether the fused kernel is built and registered (once per process; False when disabled or unbuildable)."""
    if os.environ.get("RAG_JAX_CPU_KERNEL", "1") == "0":
        return False
    cxx = _compiler()
    if cxx is None:
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build(cxx)))
    except (OSError, subprocess.CalledProcessError):
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.RagJaxFlashForward), platform="cpu")
    jax.ffi.register_ffi_target(BWD_TARGET, jax.ffi.pycapsule(lib.RagJaxFlashBackward), platform="cpu")
    jax.ffi.register_ffi_target(XENT_TARGET, jax.ffi.pycapsule(lib.RagJaxSoftmaxXent), platform="cpu")
    jax.ffi.register_ffi_target(LSH_TARGET, jax.ffi.pycapsule(lib.RagJaxLshAttend), platform="cpu")
    return True


def supported(q, spec) -> bool:
    """Static check: float32 q, head_dim a multiple of 16 (the kernel's vector width)."""
    return q.dtype == jnp.float32 and q.shape[-1] % 16 == 0 and spec.mode in MODES


def _mask_args(spec):
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)  # noqa: E731
    fields = [i32(x) for x in (*spec.q_fields(), *spec.kv_fields())]
    attrs = dict(mode=np.int64(MODES[spec.mode]),
                 window=np.int64(-1 if spec.sliding_window is None else spec.sliding_window))
    return fields, attrs


def flash_forward(q, k, v, spec):
    """``(out [b, h, g, q_len, d], lse float32 [b, h, g, q_len])`` for kernel-layout ``q`` (``blockwise.kernel_layout``:
    scaled by 1/sqrt(d)), ``k`` / ``v`` ``[b, h, kv_len, d]`` and a ``MaskSpec`` of matching lengths; a fully masked
    row gives zeros and ``lse = MASK_VALUE``, as the JAX path. Needs ``available()`` and ``supported``."""
    b, h, g, q_len, d = q.shape
    fields, attrs = _mask_args(spec)
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                     jax.ShapeDtypeStruct((b, h, g, q_len), jnp.float32)),
                             vmap_method="sequential")
    return call(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), *fields, **attrs)


def flash_backward(q, k, v, spec, lse, d_out, delta):
    """``(dq, dk, dv)`` float32 in the layouts of ``q`` / ``k`` / ``v`` (as :func:`flash_forward`'s inputs) from the
    forward's ``lse``, the output cotangent ``d_out [b, h, g, q_len, d]`` and ``delta = rowsum(d_out * out) - d_lse``
    ``[b, h, g, q_len]`` (FlashAttention-2's backward, Dao 2023, Alg. 2). Needs ``available()`` and ``supported``."""
    fields, attrs = _mask_args(spec)
    f32 = lambda x: jnp.asarray(x).astype(jnp.float32)  # noqa: E731
    call = jax.ffi.ffi_call(BWD_TARGET, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                         jax.ShapeDtypeStruct(k.shape, jnp.float32),
                                         jax.ShapeDtypeStruct(v.shape, jnp.float32)),
                             vmap_method="sequential")
    return call(*(f32(x) for x in (q, k, v, lse, d_out, delta)), *fields, **attrs)


def softmax_xent(logits, targets, weights):
    """``(dlogits, lse, target_logit, row_max)`` for float32 ``logits [rows, vocab]``, int32 ``targets [rows]`` and
    float32 ``weights [rows]``: ``dlogits = weights * (softmax(logits) - one_hot(targets))`` (written over
    ``logits``' buffer), the log-sum-exp, the target's logit and the row max, float32 ``[rows]`` each; a target
    outside ``[0, vocab)`` subtracts nothing and reads NaN. Needs ``available()``."""
    rows, vocab = logits.shape
    call = jax.ffi.ffi_call(XENT_TARGET, (jax.ShapeDtypeStruct((rows, vocab), jnp.float32),
                                          jax.ShapeDtypeStruct((rows, 3), jnp.float32)),
                             vmap_method="sequential", input_output_aliases={0: 0})
    dlogits, stats = call(logits.astype(jnp.float32), targets.astype(jnp.int32), weights.astype(jnp.float32))
    return dlogits, stats[:, 0], stats[:, 1], stats[:, 2]


def lsh_attend(q, k, v, key_mean, codes, order, offsets, keep, exact, *, bucket_size: int, max_sampled: int,
               min_collisions: int, bits: int):
    """MagicPIG's decode attention over bucket tables (``MagicPIGDecode`` with ``bucket_size`` / ``max_sampled``),
    float32 ``[b, h, g, d]``: per query row (q float32 ``[b, h, g, d]``, unscaled) the slots ``keep`` (bool ``[b, n]``)
    allows whose key shares the query's bucket (``codes`` int32 ``[b, h, g, L]``) in at least ``min_collisions``
    tables, reading at most ``bucket_size`` slots of each bucket of the tables ``order`` / ``offsets``
    (``magicpig.bucket_tables``), the first ``max_sampled`` in slot order, and every ``exact`` slot (bool ``[b, n]``)
    in one softmax over ``q.k / sqrt(d)``, minus ``log u`` on the sampled (``u`` their inclusion probability at
    the cosine to the key centred by ``key_mean`` float32 ``[b, h, 1, d]``); k / v float32 ``[b, h, n, d]``, ``d`` a
    multiple of 16. A row with no key gives zeros. Needs ``available()``."""
    call = jax.ffi.ffi_call(LSH_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    return call(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, key_mean)),
                *(jnp.asarray(x, jnp.int32) for x in (codes, order, offsets)),
                *(jnp.asarray(x, jnp.uint8) for x in (keep, exact)),
                bucket_size=np.int64(bucket_size), max_sampled=np.int64(max_sampled),
                min_collisions=np.int64(min_collisions), bits=np.int64(bits))
