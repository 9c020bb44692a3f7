"""Vendor attention kernels for masks they can express, with the blockwise path as the fallback.

- GPU: ``jax.nn.dot_product_attention(implementation="cudnn")``: ``causal`` mode without a cache
  (q_len == kv_len), right padding given as sequence lengths, a sliding window as
  ``local_window_size``; bf16/fp16 only (cuDNN flash attention has no fp32 kernel).
- TPU: Pallas splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) with segment ids.
  ``causal``: segment ids = validity, a causal mask offset by the cache length. ``block``
  (Block-Attention, Sun et al., ICLR 2025, §2.2): local queries use the real segment ids under a causal
  mask (block-local causal), global queries validity ids (plain causal): two kernel calls, the output
  selected per query by ``q_is_global``.

Whether a spec is expressible is partly static (mode, window, dtype, lengths) and partly a property of
the values (right padding, default orders, contiguous positions): the value part is checked inside the
trace and selects the kernel or the blockwise path with ``lax.cond``.

Inside a mesh (``sharding.activation_rules``, as in the train step) both dispatchers run under
``jax.shard_map``: rows split over the mesh axes of logical ``batch`` (data, fsdp) and heads over those of
``heads`` / ``kv_heads`` (tensor) where both head counts divide, so each chip calls the kernel on its own
rows and heads and XLA gathers no q/k/v around it (the partitioner cannot split a Pallas or cuDNN call
itself; MaxText wraps splash the same way). Attention is independent per row and per KV-head group, so
the result is the same as one call on the whole arrays.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from rag_jax import sharding
from rag_jax.model.blockwise import blockwise_attention, kernel_layout
from rag_jax.model.masks import MaskSpec

SPLASH_BLOCK = 128


def _zero_invalid_queries(out, spec: MaskSpec):
    return jnp.where((spec.q_segment_ids != 0)[:, :, None, None], out, jnp.zeros((), out.dtype))


def _default_orders(spec: MaskSpec):
    q_default = spec.kv_len - spec.q_len + jnp.arange(spec.q_len)
    return jnp.all(spec.q_order == q_default) & jnp.all(spec.kv_order == jnp.arange(spec.kv_len))


def cudnn_expressible(q, spec: MaskSpec) -> bool:
    """Static part: causal, no cache, half precision, head_dim a multiple of 8 up to 128."""
    d = q.shape[-1]
    return (spec.mode == "causal" and spec.q_len == spec.kv_len and q.dtype in (jnp.bfloat16, jnp.float16)
            and d % 8 == 0 and d <= 128)


def cudnn_values_ok(spec: MaskSpec) -> jax.Array:
    """Value part (scalar bool): right-padded rows, default orders and, with a window, positions equal
    to orders on valid tokens (cuDNN's window counts indices)."""
    valid = spec.kv_segment_ids != 0
    ok = jnp.all(valid[:, 1:] <= valid[:, :-1]) & _default_orders(spec)
    if spec.sliding_window is not None:
        offset = spec.kv_positions[:, :1] - spec.kv_order[:, :1]
        ok &= jnp.all(jnp.where(valid, spec.kv_positions - spec.kv_order == offset, True))
        ok &= jnp.all(jnp.where(spec.q_segment_ids != 0, spec.q_positions - spec.q_order == offset, True))
    return ok


def cudnn_attention(q, k, v, spec: MaskSpec, *, implementation: str | None = "cudnn"):
    """``jax.nn.dot_product_attention`` for a spec passing both checks above (``implementation="xla"``
    runs the same mapping on any backend, for tests). Shapes as ``attention.attend``."""
    lengths = (spec.kv_segment_ids != 0).sum(-1).astype(jnp.int32)
    window = None if spec.sliding_window is None else (spec.sliding_window - 1, 0)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                       key_value_seq_lengths=lengths, local_window_size=window,
                                       implementation=implementation)
    return _zero_invalid_queries(out, spec)


def partitioned(fn):
    """``fn(q, k, v, spec) -> out`` (shapes as ``attention.attend``) run per shard under ``jax.shard_map`` over
    the active mesh (module doc); outside a mesh, or with a single device, ``fn`` itself."""
    def run(q, k, v, spec: MaskSpec):
        active = sharding.active()
        if active is None or active[0].size == 1:
            return fn(q, k, v, spec)
        mesh, rules = active
        q_spec = sharding.logical_to_spec(("batch", None, "heads", None), mesh, rules, q.shape)
        kv_spec = sharding.logical_to_spec(("batch", None, "kv_heads", None), mesh, rules, k.shape)
        if q_spec[2] != kv_spec[2]:  # heads split only where query and KV heads split alike (GQA groups stay whole)
            q_spec, kv_spec = P(q_spec[0], None, None, None), P(kv_spec[0], None, None, None)
        rows = jax.tree.map(lambda _: P(q_spec[0], None), spec)
        return jax.shard_map(fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, rows), out_specs=q_spec,
                             check_vma=False)(q, k, v, spec)
    return run


def cudnn_or_blockwise(q, k, v, spec: MaskSpec):
    """cuDNN where ``spec`` is expressible, else blockwise; per shard inside a mesh (``partitioned``)."""
    return partitioned(_cudnn_or_blockwise)(q, k, v, spec)


def _cudnn_or_blockwise(q, k, v, spec: MaskSpec):
    def blockwise(q, k, v, spec):
        return blockwise_attention(q, k, v, spec)[0]
    if not cudnn_expressible(q, spec):
        return blockwise(q, k, v, spec)
    return jax.lax.cond(cudnn_values_ok(spec), cudnn_attention, blockwise, q, k, v, spec)


def splash_expressible(spec: MaskSpec) -> bool:
    """Static part: causal or block mode without a sliding window."""
    return spec.mode in ("causal", "block") and spec.sliding_window is None


def splash_attention(q, k, v, spec: MaskSpec, *, interpret: bool = False):
    """Splash attention for a causal/block spec with default orders. Shapes as ``attention.attend``;
    lengths are padded to multiples of ``SPLASH_BLOCK`` (padding keys have segment id 0)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    b, q_len, num_heads, d = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    g = num_heads // num_kv_heads
    q_pad, kv_pad = -q_len % SPLASH_BLOCK, -kv_len % SPLASH_BLOCK
    shape = (q_len + q_pad, kv_len + kv_pad)
    causal = masks.MultiHeadMask([masks.CausalMask(shape, offset=kv_len - q_len)] * g)
    kernel = splash.make_splash_mqa_single_device(causal, interpret=interpret)
    qt, kt, vt = kernel_layout(q, k, v, q_pad, kv_pad)
    per_head = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=ids), in_axes=(0, 0, 0, None))
    run = jax.vmap(per_head)

    def call(q_ids, kv_ids):
        ids = splash.SegmentIds(q=jnp.pad(q_ids, ((0, 0), (0, q_pad))), kv=jnp.pad(kv_ids, ((0, 0), (0, kv_pad))))
        out = run(qt, kt, vt, ids)[:, :, :, :q_len]
        return out.transpose(0, 3, 1, 2, 4).reshape(b, q_len, num_heads, d)

    q_valid, kv_valid = (spec.q_segment_ids != 0).astype(jnp.int32), (spec.kv_segment_ids != 0).astype(jnp.int32)
    out = call(q_valid, kv_valid)
    if spec.mode == "block":
        local = call(spec.q_segment_ids, spec.kv_segment_ids)
        out = jnp.where(spec.q_is_global[:, :, None, None], out, local)
    return _zero_invalid_queries(out, spec)


def splash_or_blockwise(q, k, v, spec: MaskSpec):
    """Splash where ``spec`` is expressible, else blockwise; per shard inside a mesh (``partitioned``)."""
    return partitioned(_splash_or_blockwise)(q, k, v, spec)


def _splash_or_blockwise(q, k, v, spec: MaskSpec):
    def blockwise(q, k, v, spec):
        return blockwise_attention(q, k, v, spec)[0]
    if not splash_expressible(spec):
        return blockwise(q, k, v, spec)
    return jax.lax.cond(_default_orders(spec), splash_attention, blockwise, q, k, v, spec)
