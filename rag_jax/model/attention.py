"""The one attention function: grouped-query attention over already-rotated q and k.

``attend_joint`` computes logits for several (q, k, v, mask) groups and normalizes them with ONE
softmax — EM-LLM's joint softmax over the local window and retrieved memory (Fountas et al.,
ICLR 2025, §3.3, following InfLLM), where each group may use a different query rotation.
``attend`` is the single-group case. Logits and softmax are float32; masked logits get a large
finite negative so a fully masked row (a padding query) yields finite output, never NaN.
"""
from __future__ import annotations

import einops
import jax
import jax.numpy as jnp

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _group_logits(q, k, mask):
    """q ``[b, q_len, num_heads, head_dim]``, k ``[b, kv_len, num_kv_heads, head_dim]`` ->
    float32 logits ``[b, num_kv_heads, group, q_len, kv_len]`` (masked, scaled by 1/sqrt(head_dim))."""
    num_kv_heads = k.shape[2]
    if q.shape[2] % num_kv_heads:
        raise ValueError(f"num_heads={q.shape[2]} must be a multiple of num_kv_heads={num_kv_heads}")
    qg = einops.rearrange(q, "b q (h g) d -> b h g q d", h=num_kv_heads)
    logits = jnp.einsum("bhgqd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
    logits = logits * (q.shape[-1] ** -0.5)
    return jnp.where(mask[:, None, None, :, :], logits, MASK_VALUE)


def attend_joint(groups, *, return_weights: bool = False):
    """One softmax over the concatenated logits of ``groups = [(q, k, v, mask), ...]``.

    Shapes per group: q ``[batch, q_len, num_heads, head_dim]`` (rotated), k/v
    ``[batch, kv_len_i, num_kv_heads, head_dim]`` (k rotated), mask bool ``[batch, q_len, kv_len_i]``.
    Returns ``[batch, q_len, num_heads, head_dim]`` in q's dtype; with ``return_weights`` also the
    float32 attention weights ``[batch, num_kv_heads, heads_per_kv_head, q_len, sum(kv_len_i)]``
    (keys in group order), e.g. EM-LLM's representative-token scores.

    Raises:
      ValueError: num_heads is not a multiple of num_kv_heads.
    """
    logits = jnp.concatenate([_group_logits(q, k, m) for q, k, _, m in groups], axis=-1)
    weights = jax.nn.softmax(logits, axis=-1)
    v = jnp.concatenate([g[2] for g in groups], axis=1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = einops.rearrange(out, "b q h g d -> b q (h g) d").astype(groups[0][0].dtype)
    return (out, weights) if return_weights else out


def attend(q, k, v, mask) -> jnp.ndarray:
    """Grouped-query attention ``softmax(q·kᵀ/√head_dim + mask)·v``.

    q ``[batch, q_len, num_heads, head_dim]``, k/v ``[batch, kv_len, num_kv_heads, head_dim]``,
    mask bool ``[batch, q_len, kv_len]`` -> ``[batch, q_len, num_heads, head_dim]``.
    """
    return attend_joint([(q, k, v, mask)])
