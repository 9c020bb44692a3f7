"""Rotary position embeddings (RoPE), HF ``rotate_half`` layout, with Llama-3.1 frequency scaling.

Keys are stored pre-RoPE throughout rag-jax, so moving a cached block to another offset
(Block-Attention's re-encoding ``k = R(o)·k̃``) is just rotating at new positions.
"""
from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None = None) -> jnp.ndarray:
    """Inverse frequencies ``theta^(-2i/head_dim)``, float32 ``[head_dim // 2]``.

    ``rope_scaling={"rope_type": "llama3", ...}`` applies the Llama 3.1 band-wise rescaling
    (low frequencies divided by ``factor``, high ones kept, a smooth ramp in between);
    ``"linear"`` divides all frequencies by ``factor`` (position interpolation).
    Computed in float64 NumPy and cast once, so it matches HF's float32 values.
    """
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    inv_freq = inv_freq.astype(np.float32)
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rope_type == "linear":
            inv_freq = inv_freq / np.float32(rope_scaling["factor"])
        elif rope_type == "llama3":
            factor = rope_scaling["factor"]
            low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
            old_len = rope_scaling["original_max_position_embeddings"]
            low_wavelen, high_wavelen = old_len / low, old_len / high
            wavelen = 2 * math.pi / inv_freq
            scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return jnp.asarray(inv_freq, jnp.float32)


def rope_angles(positions: jnp.ndarray, inv_freq: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """float32 ``(cos, sin)`` ``[batch, seq, 1, head_dim]`` of integer ``positions: [batch, seq]``.

    Computed once per forward and shared by every layer: the trigonometry of a long cached prefix
    costs more than the rotation itself (issue 17's Block-Attention TTFT)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, seq, head_dim/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate ``x: [batch, seq, heads, head_dim]`` by ``rope_angles`` tables; float32 math, ``x.dtype`` out."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated_half = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated_half * sin).astype(x.dtype)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: jnp.ndarray) -> jnp.ndarray:
    """Rotate ``x: [batch, seq, heads, head_dim]`` to integer ``positions: [batch, seq]``.

    Angles are computed in float32 and the result is cast back to ``x.dtype``.
    """
    return rotate(x, *rope_angles(positions, inv_freq))
