"""The one attention function: grouped-query attention over already-rotated q and k, on every backend.

``attend(q, k, v, mask, impl=...)`` takes the mask either as a structural ``MaskSpec`` (segment ids,
orders, positions, global flags, mode, window: O(seq) memory) or as a dense bool ``[batch, q, kv]``
array (the dense path only). Implementations (``ATTENTION_IMPLS``):

- ``dense``: the reference. float32 logits ``[b, kv_heads, group, q, kv]``, the mask built from the spec.
- ``blockwise``: flash-style online softmax in pure JAX (``blockwise.py``), any backend, O(seq) memory.
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU) where the mask is expressible
  (``kernels.py``), otherwise blockwise.
- ``splash``: Pallas splash attention (TPU) with segment ids, otherwise blockwise.
- ``auto``: cudnn on GPU, splash on TPU, and on CPU dense up to ``AUTO_DENSE_MAX_PAIRS`` (query, key)
  pairs per head, blockwise beyond.

``attend_cache`` is the dense path on a heads-first decode cache (``kv.DecodeCache``): one query per row
over a long cache, where transposing the cached keys every step would cost more than attending them.

``attend_joint`` computes several (q, k, v, mask) groups under ONE softmax — EM-LLM's joint softmax over
the local window and retrieved memory (Fountas et al., ICLR 2025, §3.3, following InfLLM), where each
group may use a different query rotation. On the kernel paths each group runs separately and the
results are merged by log-sum-exp (exact: ``out = Σ_g exp(lse_g - lse) · out_g``). With ``return_lse`` it
also returns the joint log-sum-exp, from which ``key_mass`` gives the attention mass a group's keys
receive (EM-LLM's representative-token scores, §3.2) without the ``[q, kv]`` weights of every group.

Logits and softmax are float32; a fully masked query row (padding) yields a zero output on every path.
"""
from __future__ import annotations

import einops
import jax
import jax.numpy as jnp

from rag_jax.model import cpu_kernel, kernels
from rag_jax.model.blockwise import MASK_VALUE, blockwise_attention
from rag_jax.model.config import ATTENTION_IMPLS
from rag_jax.model.masks import MaskSpec

# On CPU, auto runs dense up to one blockwise tile (256 x 256 pairs per head): SmolLM2-135M prefill was
# already ~2x faster blockwise at 1K tokens (bench/attention.py), and blockwise memory stays flat. A few
# queries over a long cache (Block-Attention's last block, decoding) run dense up to 2^20 pairs per head:
# 50 queries over 3,050 cached keys took 6.6 ms per SmolLM2 layer dense vs 8.2 ms blockwise (one thread).
AUTO_DENSE_MAX_PAIRS = 256 * 256
AUTO_DENSE_SHORT_Q = 128             # queries
AUTO_DENSE_SHORT_Q_MAX_PAIRS = 1 << 20
# With the fused CPU kernel (cpu_kernel) blockwise wins from 16 queries on, over any cache: one SmolLM2 layer in
# block mode (a global last block over cached passages; 2 cores, same process), 50 x 3,050 pairs 3.15 vs 4.50 ms
# dense, 20 x 3,020 2.11 vs 2.65, 128 x 3,128 7.35 vs 9.73, 50 x 9,050 9.67 vs 12.19, 16 x 528 0.52 vs 0.57; with
# up to 8 queries dense stays ahead (1 x 3,001 0.80 vs 1.07 ms, 8 x 3,008 1.30 vs 1.50).
AUTO_DENSE_FUSED_MAX_Q = 8


def check_impl(impl: str) -> None:
    """Raises ValueError naming the value and the valid implementations."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r} is not supported; valid: {ATTENTION_IMPLS}")


def resolve_impl(impl: str, q_len: int, kv_len: int, backend: str | None = None) -> str:
    """The concrete implementation ``attend`` runs for ``impl`` on ``backend`` (default: JAX's default
    backend) at the given lengths. Kernel paths whose mask is not expressible fall back to blockwise
    inside ``attend`` (see ``kernels``)."""
    check_impl(impl)
    if impl != "auto":
        return impl
    backend = backend or jax.default_backend()
    if backend in ("gpu", "cuda", "rocm"):
        return "cudnn"
    if backend == "tpu":
        return "splash"
    pairs = q_len * kv_len
    short_q = AUTO_DENSE_FUSED_MAX_Q if cpu_kernel.available() else AUTO_DENSE_SHORT_Q
    short = q_len <= short_q and pairs <= AUTO_DENSE_SHORT_Q_MAX_PAIRS
    return "dense" if pairs <= AUTO_DENSE_MAX_PAIRS or short else "blockwise"


def _group_logits(q, kt, mask):
    """q ``[b, q_len, num_heads, head_dim]``, kt ``[b, num_kv_heads, kv_len, head_dim]`` (heads first) ->
    float32 logits ``[b, num_kv_heads, group, q_len, kv_len]`` (masked, scaled by 1/sqrt(head_dim)).

    The query heads of a KV head and their positions form one ``group * q_len`` row dimension of a
    single matmul per KV head (fast for a short last block over a long cache, Block-Attention's TTFT)."""
    num_kv_heads, q_len = kt.shape[1], q.shape[1]
    if q.shape[2] % num_kv_heads:
        raise ValueError(f"num_heads={q.shape[2]} must be a multiple of num_kv_heads={num_kv_heads}")
    qg = einops.rearrange(q, "b q (h g) d -> b h (g q) d", h=num_kv_heads)
    logits = jnp.einsum("bhmd,bhkd->bhmk", qg, kt, preferred_element_type=jnp.float32) * (q.shape[-1] ** -0.5)
    logits = einops.rearrange(logits, "b h (g q) k -> b h g q k", q=q_len)
    return jnp.where(mask[:, None, None, :, :], logits, MASK_VALUE)


def _dense_mask(mask):
    return mask.dense() if isinstance(mask, MaskSpec) else mask


def _heads_first(x):
    return einops.rearrange(x, "b k h d -> b h k d")


def _dense_joint(groups):
    """The dense reference on token-major k/v (``attend_joint``'s layout): ``(out, lse)``."""
    return _dense_heads_first([(q, _heads_first(k), _heads_first(v), m) for q, k, v, m in groups])


def _dense_heads_first(groups):
    """Dense joint softmax over groups ``(q, kt, vt, mask)`` with ``kt``/``vt [b, num_kv_heads, kv_len, d]``:
    ``(out [b, q, num_heads, d], lse float32 [b, num_kv_heads, group, q])``. Softmax normalized after the
    value matmul (``exp(s - max) @ v / sum``): one pass less over the ``[q, kv]`` weights. A fully masked row
    (max = ``MASK_VALUE``) divides by infinity: zero output, lse ``MASK_VALUE``."""
    logits = jnp.concatenate([_group_logits(q, kt, _dense_mask(m)) for q, kt, _, m in groups], axis=-1)
    row_max = logits.max(-1, keepdims=True)
    e = jnp.exp(logits - row_max)
    valid = row_max > MASK_VALUE / 2
    sums = e.sum(-1, keepdims=True)
    total = jnp.where(valid, sums, jnp.inf)
    v = jnp.concatenate([g[2] for g in groups], axis=2)
    q_len = groups[0][0].shape[1]
    out = jnp.einsum("bhmk,bhkd->bhmd", einops.rearrange(e, "b h g q k -> b h (g q) k").astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    out = einops.rearrange(out, "b h (g q) d -> b h g q d", q=q_len) / total
    out = einops.rearrange(out, "b h g q d -> b q (h g) d").astype(groups[0][0].dtype)
    lse = jnp.where(valid, row_max + jnp.log(sums), MASK_VALUE)[..., 0]
    return out, lse


def attend_cache(q, kt, vt, mask) -> jnp.ndarray:
    """Attention of a few new queries over a heads-first decode cache (``kv.DecodeCache``), dense on every
    backend: q ``[batch, q_len, num_heads, head_dim]`` (rotated), kt/vt ``[batch, num_kv_heads, kv_len,
    head_dim]`` (kt rotated), mask a ``MaskSpec`` or bool ``[batch, q_len, kv_len]`` ->
    ``[batch, q_len, num_heads, head_dim]`` in q's dtype. Same math as ``attend(..., impl="dense")``."""
    return _dense_heads_first([(q, kt, vt, mask)])[0]


def _merge_lse(outs, lses):
    """Exact joint softmax of groups attended separately: ``out [b, q, H, d]``, ``lse [b, kvh, g, q]`` per
    group -> ``(out, joint lse)``."""
    lse = jax.nn.logsumexp(jnp.stack(lses), axis=0)
    out = 0.0
    for o, l in zip(outs, lses):
        w = einops.rearrange(jnp.exp(l - lse), "b h g q -> b q (h g) 1")
        out = out + w * o.astype(jnp.float32)
    return out.astype(outs[0].dtype), lse


def attend_joint(groups, *, return_lse: bool = False, impl: str = "auto"):
    """One softmax over the concatenated logits of ``groups = [(q, k, v, mask), ...]``.

    Shapes per group: q ``[batch, q_len, num_heads, head_dim]`` (rotated), k/v
    ``[batch, kv_len_i, num_kv_heads, head_dim]`` (k rotated), mask a ``MaskSpec`` or bool
    ``[batch, q_len, kv_len_i]``. Returns ``[batch, q_len, num_heads, head_dim]`` in q's dtype; with
    ``return_lse`` also the float32 log-sum-exp of each query's joint logits ``[batch, num_kv_heads,
    heads_per_kv_head, q_len]`` (``MASK_VALUE`` for a row with no visible key), the input of ``key_mass``.

    Any dense mask runs the dense reference; otherwise ``impl`` (see module doc) runs each group and the
    groups are merged by log-sum-exp (blockwise for more than one group, or with ``return_lse``).

    Raises:
      ValueError: num_heads is not a multiple of num_kv_heads, or an unknown ``impl``.
    """
    check_impl(impl)
    q_len = groups[0][0].shape[1]
    kv_len = sum(g[1].shape[1] for g in groups)
    dense = not all(isinstance(m, MaskSpec) for *_, m in groups)
    chosen = "dense" if dense else resolve_impl(impl, q_len, kv_len)
    if chosen == "dense":
        out, lse = _dense_joint(groups)
    elif len(groups) == 1 and not return_lse and chosen in ("cudnn", "splash"):
        q, k, v, spec = groups[0]
        kernel = kernels.cudnn_or_blockwise if chosen == "cudnn" else kernels.splash_or_blockwise
        return kernel(q, k, v, spec)
    elif len(groups) == 1:
        out, lse = blockwise_attention(*groups[0])
    else:
        outs, lses = zip(*(blockwise_attention(q, k, v, spec) for q, k, v, spec in groups))
        out, lse = _merge_lse(outs, lses)
    return (out, lse) if return_lse else out


def key_mass(q, k, mask, lse, query_weights) -> jnp.ndarray:
    """Attention mass the keys of one ``attend_joint`` group receive: ``Σ_q w[n, q] · p(q, key)``.

    Args:
      q: ``[batch, q_len, num_heads, head_dim]`` (rotated), k: ``[batch, kv_len, num_kv_heads, head_dim]``
        (rotated), mask: a ``MaskSpec`` or bool ``[batch, q_len, kv_len]``: the group as given to
        ``attend_joint``.
      lse: float32 ``[batch, num_kv_heads, heads_per_kv_head, q_len]`` from ``attend_joint(...,
        return_lse=True)`` over all the groups (so ``p`` is the joint softmax weight).
      query_weights: float ``[batch, n, q_len]``: ``n`` weightings of the queries (EM-LLM: 1 on valid
        queries; a one-hot row gives one query's weights; the identity gives every weight).

    Returns:
      float32 ``[batch, n, num_heads, kv_len]``. Dense (``[q, kv]`` logits per head) on every backend.
    """
    logits = _group_logits(q, _heads_first(k), _dense_mask(mask))          # [b, kvh, g, q, kv]
    p = jnp.where(logits > MASK_VALUE / 2, jnp.exp(logits - lse[..., None]), 0.0)
    mass = jnp.einsum("bnq,bhgqk->bnhgk", query_weights.astype(jnp.float32), p)
    return einops.rearrange(mass, "b n h g k -> b n (h g) k")


def attend(q, k, v, mask, *, impl: str = "auto") -> jnp.ndarray:
    """Grouped-query attention ``softmax(q·kᵀ/√head_dim + mask)·v``.

    q ``[batch, q_len, num_heads, head_dim]``, k/v ``[batch, kv_len, num_kv_heads, head_dim]``,
    mask a ``MaskSpec`` (any ``impl``) or bool ``[batch, q_len, kv_len]`` (dense path)
    -> ``[batch, q_len, num_heads, head_dim]`` in q's dtype.
    """
    return attend_joint([(q, k, v, mask)], impl=impl)
