"""Blockwise (flash-style) attention in pure JAX: online softmax over KV chunks, O(chunk²) memory per head.

The algorithm is FlashAttention's (Dao et al., NeurIPS 2022, Alg. 1 forward / Alg. 2 backward with the
``D = rowsum(dO ∘ O)`` trick): queries are cut into ``q_chunk`` tiles and, for each, only the KV chunks
the structural mask can reach are visited (``MaskSpec.chunk_classes``: a dynamic ``[lo, hi)`` chunk range
per query tile plus a ``lax.switch`` that skips tiles inside it the structure masks out, e.g. other
blocks in Block-Attention, and drops the mask on tiles it allows entirely, e.g. below the causal
diagonal). The mask of a partial tile is ``MaskSpec.allowed`` on the two slices, the same predicate the
dense reference uses. A custom VJP recomputes tiles in the backward pass from the
saved per-row log-sum-exp, so training memory is O(seq), not O(seq²). GQA is computed per KV head with
the query heads of the group as an extra free dimension (k / v are never repeated).

On the CPU backend both passes run the fused C++ kernels of ``cpu_kernel`` (same algorithms, one thread per
task over all cores) where they are built; the tile loops here are the fallback.

A fully masked query row (padding) yields a zero output and ``lse = MASK_VALUE``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rag_jax.model import cpu_kernel
from rag_jax.model.masks import SKIP, MaskSpec

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Default tiles (tokens). Measured on a 2-core Xeon (one SmolLM2 layer, 9 query / 3 KV heads, causal): the
# forward at 2K-8K tokens ran 1.23-1.38x faster with 512 x 512 tiles than 256 x 256 (at 1K equal), the
# backward at 2K 2x slower, so the backward keeps TILE (``_flash_bwd`` re-tiles).
TILE = 256
LONG_TILE = 512
LONG_FROM = 2048   # query and key lengths from which the forward uses LONG_TILE


def _chunk_ranges(classes):
    """classes int ``[nq, nk]`` -> first / one-past-last KV chunk to visit per query tile (``hi <= lo``: none)."""
    need = classes != SKIP
    nk = need.shape[1]
    idx = jnp.arange(nk)
    return jnp.where(need, idx, nk).min(1), jnp.where(need, idx + 1, 0).max(1)


def _visit(classes, i, j, visit, carry):
    """``visit(carry, masked)`` on tile (i, j) unless the structure skips it; no mask on full tiles."""
    branches = [lambda c: c, lambda c: visit(c, True), lambda c: visit(c, False)]
    return jax.lax.switch(classes[i, j], branches, carry)


def _slice(x, start, size, axis):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _tile(q, k, spec, i, j, qc, kc, masked: bool):
    """Scaled logits of tile (i, j): q ``[b, h, g, qc, d]`` slice, k ``[b, h, kc, d]`` slice, and the mask
    broadcast to ``[b, 1, 1, qc, kc]`` (``True`` when not ``masked``: a full tile)."""
    qi = _slice(q, i * qc, qc, 3)
    kj = _slice(k, j * kc, kc, 2)
    s = jnp.einsum("bhgqd,bhkd->bhgqk", qi, kj, preferred_element_type=jnp.float32)
    if not masked:
        return qi, kj, s, True
    mask = spec.allowed([_slice(x, i * qc, qc, 1) for x in spec.q_fields()],
                        [_slice(x, j * kc, kc, 1) for x in spec.kv_fields()])[:, None, None]
    return qi, kj, jnp.where(mask, s, MASK_VALUE), mask


def _forward(q, k, v, spec, classes, qc, kc):
    b, h, g, q_len, d = q.shape
    lo, hi = _chunk_ranges(classes)

    def q_tile(i):
        def kv_step(j, carry):
            def visit(carry, masked):
                m, l, acc = carry
                _, _, s, mask = _tile(q, k, spec, i, j, qc, kc, masked)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
                alpha = jnp.exp(m - m_new)
                vj = _slice(v, j * kc, kc, 2)
                pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
                return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv
            return _visit(classes, i, j, visit, carry)

        init = (jnp.full((b, h, g, qc), MASK_VALUE, jnp.float32), jnp.zeros((b, h, g, qc), jnp.float32),
                jnp.zeros((b, h, g, qc, d), jnp.float32))
        m, l, acc = jax.lax.fori_loop(lo[i], hi[i], kv_step, init)
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        return out.astype(q.dtype), jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), MASK_VALUE)

    out, lse = jax.lax.map(q_tile, jnp.arange(q_len // qc))        # [nq, b, h, g, qc, (d)]
    out = jnp.moveaxis(out, 0, 3).reshape(b, h, g, q_len, d)
    return out, jnp.moveaxis(lse, 0, 3).reshape(b, h, g, q_len)


def _forward_any(q, k, v, spec, classes, qc, kc):
    """The fused C++ forward (``cpu_kernel``) on the CPU backend where it is built and applies, else ``_forward``;
    the same ``(out, lse)``."""
    plain = functools.partial(_forward, classes=classes, qc=qc, kc=kc)
    # a CPU host only (no compiler run on a GPU / TPU machine); an AOT compile for TPU on a CPU host keeps the JAX
    # path through platform_dependent, which picks by the platform the program is lowered for
    if not (jax.default_backend() == "cpu" and cpu_kernel.supported(q, spec) and cpu_kernel.available()):
        return plain(q, k, v, spec)
    return jax.lax.platform_dependent(q, k, v, spec, cpu=cpu_kernel.flash_forward, default=plain)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _flash(q, k, v, spec, classes, qc, kc, bwd_tiles):
    return _forward_any(q, k, v, spec, classes, qc, kc)


def _flash_fwd(q, k, v, spec, classes, qc, kc, bwd_tiles):
    out, lse = _forward_any(q, k, v, spec, classes, qc, kc)
    return (out, lse), (q, k, v, spec, classes, out, lse)


def _flash_bwd(qc, kc, bwd_tiles, res, cotangents):
    q, k, v, spec, classes, out, lse = res
    d_out, d_lse = cotangents
    delta = jnp.einsum("bhgqd,bhgqd->bhgq", d_out.astype(jnp.float32), out.astype(jnp.float32)) - d_lse
    if bwd_tiles != (qc, kc):  # the backward's own tile sizes (they divide the forward's)
        (qc, kc), classes = bwd_tiles, spec.chunk_classes(*bwd_tiles)
    plain = functools.partial(_backward, classes=classes, qc=qc, kc=kc)
    if jax.default_backend() == "cpu" and cpu_kernel.supported(q, spec) and cpu_kernel.available():
        dq, dk, dv = jax.lax.platform_dependent(q, k, v, spec, lse, d_out, delta, cpu=cpu_kernel.flash_backward,
                                                default=plain)
    else:
        dq, dk, dv = plain(q, k, v, spec, lse, d_out, delta)

    def no_grad(x):
        return np.zeros(x.shape, jax.dtypes.float0)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), jax.tree.map(no_grad, spec), no_grad(classes))


def _backward(q, k, v, spec, lse, d_out, delta, classes, qc, kc):
    """The JAX tile loop of the backward: float32 ``(dq, dk, dv)`` (the fused kernel's fallback)."""
    b, h, g, q_len, d = q.shape
    lo, hi = _chunk_ranges(classes)

    def q_tile(carry, i):
        do_i = _slice(d_out, i * qc, qc, 3)
        lse_i, delta_i = _slice(lse, i * qc, qc, 3), _slice(delta, i * qc, qc, 3)

        def kv_step(j, inner):
            def visit(inner, masked):
                dq_i, dk, dv = inner
                qi, kj, s, mask = _tile(q, k, spec, i, j, qc, kc, masked)
                vj = _slice(v, j * kc, kc, 2)
                p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)
                dv_j = jnp.einsum("bhgqk,bhgqd->bhkd", p.astype(d_out.dtype), do_i, preferred_element_type=jnp.float32)
                dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_i, vj, preferred_element_type=jnp.float32)
                ds = (p * (dp - delta_i[..., None])).astype(q.dtype)
                dq_i = dq_i + jnp.einsum("bhgqk,bhkd->bhgqd", ds, kj, preferred_element_type=jnp.float32)
                dk_j = jnp.einsum("bhgqk,bhgqd->bhkd", ds, qi, preferred_element_type=jnp.float32)
                dk = jax.lax.dynamic_update_slice_in_dim(dk, _slice(dk, j * kc, kc, 2) + dk_j, j * kc, 2)
                dv = jax.lax.dynamic_update_slice_in_dim(dv, _slice(dv, j * kc, kc, 2) + dv_j, j * kc, 2)
                return dq_i, dk, dv
            return _visit(classes, i, j, visit, inner)

        dq_i = jnp.zeros((b, h, g, qc, d), jnp.float32)
        dq_i, dk, dv = jax.lax.fori_loop(lo[i], hi[i], kv_step, (dq_i, *carry))
        return (dk, dv), dq_i

    zeros_kv = jnp.zeros(k.shape, jnp.float32)
    (dk, dv), dq = jax.lax.scan(q_tile, (zeros_kv, zeros_kv), jnp.arange(q_len // qc))
    return jnp.moveaxis(dq, 0, 3).reshape(q.shape), dk, dv


_flash.defvjp(_flash_fwd, _flash_bwd)


def kernel_layout(q, k, v, q_pad: int, kv_pad: int):
    """q ``[b, q_len, num_heads, d]`` -> scaled by 1/√d, ``[b, num_kv_heads, heads_per_kv_head, q_len + q_pad, d]``;
    k / v ``[b, kv_len, num_kv_heads, d]`` -> ``[b, num_kv_heads, kv_len + kv_pad, d]`` (zero padding)."""
    b, q_len, num_heads, d = q.shape
    num_kv_heads = k.shape[2]
    qt = (q * jnp.asarray(d ** -0.5, q.dtype)).reshape(b, q_len, num_kv_heads, num_heads // num_kv_heads, d)
    qt = jnp.pad(qt.transpose(0, 2, 3, 1, 4), ((0, 0),) * 3 + ((0, q_pad), (0, 0)))
    kt, vt = (jnp.pad(x.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, kv_pad), (0, 0))) for x in (k, v))
    return qt, kt, vt


def blockwise_attention(q, k, v, spec: MaskSpec, *, q_chunk: int | None = None, kv_chunk: int | None = None):
    """Exact attention ``softmax(q·kᵀ/√head_dim + mask)·v`` without ``[q_len, kv_len]`` tensors.

    Args:
      q: ``[batch, q_len, num_heads, head_dim]`` (rotated).
      k, v: ``[batch, kv_len, num_kv_heads, head_dim]`` (k rotated); ``num_kv_heads`` divides ``num_heads``.
      spec: the structural ``MaskSpec`` (q_len / kv_len must match).
      q_chunk, kv_chunk: tile sizes in tokens (clipped to the lengths; inputs are padded to multiples).
        With ``q_len < q_chunk`` the KV tile grows by ``q_chunk // q_len`` (same pairs per tile). Default
        (None): ``TILE``, and ``LONG_TILE`` in the forward pass when both lengths are at least ``LONG_FROM``
        (the backward then runs on ``TILE`` tiles); given sizes apply to both passes.

    Returns:
      ``(out [batch, q_len, num_heads, head_dim] in q's dtype, lse float32 [batch, num_kv_heads,
      heads_per_kv_head, q_len])``: ``lse`` is the natural log-sum-exp of each row's masked logits
      (``MASK_VALUE`` for a fully masked row, whose output is zero), used to merge joint softmax groups.

    Raises:
      ValueError: shapes of q / k / v / spec disagree.
    """
    b, q_len, num_heads, d = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if (spec.q_len, spec.kv_len) != (q_len, kv_len) or v.shape != k.shape:
        raise ValueError(f"mask spec covers q_len={spec.q_len}, kv_len={spec.kv_len} but q has {q_len} tokens, "
                         f"k {kv_len}, v shape {tuple(v.shape)}")
    long = q_chunk is None and kv_chunk is None and min(q_len, kv_len) >= LONG_FROM
    q_chunk, kv_chunk = (LONG_TILE, LONG_TILE) if long else (q_chunk or TILE, kv_chunk or TILE)
    qc = min(q_chunk, q_len)
    # few queries (a last block over a long cache, decoding): wider KV tiles, same tile size in pairs
    kc = min(kv_chunk * max(1, q_chunk // qc), kv_len)
    q_pad, kv_pad = -q_len % qc, -kv_len % kc
    qt, kt, vt = kernel_layout(q, k, v, q_pad, kv_pad)
    spec = spec.pad(q_len + q_pad, kv_len + kv_pad)
    out, lse = _flash(qt, kt, vt, spec, spec.chunk_classes(qc, kc), qc, kc, (TILE, TILE) if long else (qc, kc))
    out = out[:, :, :, :q_len].transpose(0, 3, 1, 2, 4).reshape(b, q_len, num_heads, d)
    return out, lse[..., :q_len]
