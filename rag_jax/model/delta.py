"""Low-rank weight deltas: a fine-tuned model shipped as a few MB on top of the base model it was tuned from.

A tuned model that changed only some parameters (e.g. the top layers of Block-Attention distillation) is stored
as the difference to its base: each changed matrix ``W_tuned - W_base`` as its best rank-``r`` factorisation
``A @ B`` (truncated SVD, Eckart-Young: the closest rank-``r`` matrix in Frobenius norm), as LoRA stores an
adapter (Hu et al., ICLR 2022), and each changed vector (norm scales, biases) in full. Factors are bfloat16 in a
``safetensors`` file; the header's metadata names the base model and any settings the tuned model needs (its
Block-Attention ``block_prefix``). ``relative_error`` states, per matrix, what the truncation loses.

    delta = low_rank_delta(base, tuned, rank=32)            # {"layers/22/mlp/up": (A, B), ...}
    save_delta("delta.safetensors", delta, {"base": "smollm2-135m-instruct", "block_prefix": "sink"})
    model = apply_delta(base, "delta.safetensors")          # a new model; base is unchanged
"""
from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save

from rag_jax.atomic import write_bytes
from rag_jax.model.lora import merge_lora
from rag_jax.model.transformer import to_scanned, to_unrolled


def _flat(model) -> dict[str, np.ndarray]:
    """Parameters by path, one entry per layer (``layers/3/mlp/up``) also for a scanned model; LoRA adapters
    folded into their weights (``lora.merge_lora``: a LoRA-tuned model's delta is exact at the adapters' rank)."""
    flat = nnx.to_flat_state(nnx.state(to_unrolled(merge_lora(model)), nnx.Param))
    return {"/".join(map(str, path)): np.asarray(v.get_value(), np.float32)
            for path, v in flat}


def low_rank_delta(base, tuned, rank: int) -> dict[str, tuple[np.ndarray, ...]]:
    """``{parameter path: (A [m, r], B [r, n])}`` for every changed matrix (arrays of ndim > 2 as ``_matrix``) and
    ``{path: (delta,)}`` for every changed vector of ``tuned`` relative to ``base`` (Transformers of one config),
    float32; ``r = min(rank, min(m, n))``.

    Raises:
      ValueError: ``rank < 1``, or models whose parameters differ in names or shapes.
    """
    if rank < 1:
        raise ValueError(f"rank={rank} must be >= 1")
    a, b = _flat(base), _flat(tuned)
    if {k: v.shape for k, v in a.items()} != {k: v.shape for k, v in b.items()}:
        raise ValueError("base and tuned models have different parameters; a delta needs one architecture")
    out = {}
    for name, w in b.items():
        d = w.astype(np.float64) - a[name]
        if not np.any(d):
            continue
        if d.ndim >= 2:
            u, s, vt = np.linalg.svd(_matrix(d), full_matrices=False)
            r = min(rank, len(s))
            out[name] = ((u[:, :r] * s[:r]).astype(np.float32), vt[:r].astype(np.float32))
        else:
            out[name] = (d.astype(np.float32),)
    return out


def _matrix(x: np.ndarray) -> np.ndarray:
    """An array of ndim >= 2 as the matrix ``[prod(shape[:k]), prod(shape[k:])]`` closest to square (a projection
    ``[hidden, heads, head_dim]`` -> ``[hidden, heads * head_dim]``)."""
    k = min(range(1, x.ndim), key=lambda k: abs(np.log(np.prod(x.shape[:k]) / np.prod(x.shape[k:]))))
    return x.reshape(int(np.prod(x.shape[:k])), -1)


def relative_error(base, tuned, delta) -> dict[str, float]:
    """``{path: ||(base + delta) - tuned||_F / ||tuned - base||_F}`` per changed parameter (0 = exact)."""
    a, b = _flat(base), _flat(tuned)
    return {name: float(np.linalg.norm(a[name] + _dense(f, a[name].shape) - b[name])
                        / np.linalg.norm(b[name] - a[name])) for name, f in delta.items()}


def _dense(factors, shape) -> np.ndarray:
    d = factors[0] if len(factors) == 1 else factors[0].astype(np.float32) @ factors[1].astype(np.float32)
    return d.reshape(shape)


def save_delta(path: str | os.PathLike, delta: dict, metadata: dict[str, str]) -> Path:
    """Write ``delta`` (``low_rank_delta``) as bfloat16 safetensors with string ``metadata`` (atomic)."""
    arrays = {}
    for name, factors in delta.items():
        for i, f in enumerate(factors):
            arrays[f"{name}#{i}"] = np.asarray(jnp.asarray(f, jnp.bfloat16))
    return write_bytes(path, save(arrays, metadata={k: str(v) for k, v in metadata.items()}))


def delta_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The string metadata ``save_delta`` wrote. Raises ValueError naming the file when it is not safetensors."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            return dict(f.metadata() or {})
    except Exception as e:  # safetensors raises its own error types for truncated or foreign files
        raise ValueError(f"model file {path}: not a readable safetensors file ({e})") from None


def apply_delta(base, path: str | os.PathLike):
    """A new Transformer: ``base`` plus the delta in ``path`` (``base`` is not changed).

    Raises:
      ValueError: the file names a parameter ``base`` lacks or has a factor of the wrong shape.
    """
    arrays = load_file(str(path))
    grouped: dict[str, list] = {}
    for key in sorted(arrays):
        name, i = key.rsplit("#", 1)
        grouped.setdefault(name, []).append((int(i), arrays[key]))
    scanned, base = base.config.scan_layers, to_unrolled(base)
    params = _flat(base)
    for name, parts in grouped.items():
        if name not in params:
            raise ValueError(f"delta {path}: parameter {name!r} is not in the base model")
        factors = [np.asarray(x, np.float32) for _, x in sorted(parts)]
        size = factors[0].size if len(factors) == 1 else factors[0].shape[0] * factors[-1].shape[-1]
        if size != params[name].size:
            raise ValueError(f"delta {path}: {name!r} has {size} values, the base model's {params[name].shape}")
        d = _dense(factors, params[name].shape)
        params[name] = params[name] + d
    graphdef, state = nnx.split(base)
    state = jax.tree.map(lambda x: x, state)
    flat = dict(nnx.to_flat_state(state))
    for path_, v in flat.items():
        key = "/".join(map(str, path_))
        if key in grouped:
            v.set_value(jnp.asarray(params[key], v.get_value().dtype))
    model = nnx.merge(graphdef, state)
    return to_scanned(model) if scanned else model
