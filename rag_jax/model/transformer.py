"""Llama-family decoder in Flax NNX: RMSNorm, RoPE, GQA, SwiGLU, optional QKV bias, tied embeddings.

One forward serves every method: explicit ``positions``, a structural mask (``masks.MaskSpec``) from
``segment_ids`` / ``is_global`` / ``mode`` passed down to the attention kernel chosen by
``ModelConfig.attention_impl`` (no dense ``[q, kv]`` mask outside the dense path), and optional cached
``KVSegment``s attended before the new tokens. Tensor layout follows HF (``rotate_half`` RoPE, no folded query scale) so checkpoint
conversion is a rename plus transposes (``hf.py``). Parameters carry logical axis names
(``vocab, embed, mlp, heads, kv_heads, head_dim, norm``) that ``rag_jax.sharding`` maps to mesh axes.

Over 500 lines on purpose: the modules (norm, attention projections with their LoRA adapters, MLP, layer,
model) and the two layer layouts (unrolled / stacked-and-scanned, ``to_scanned`` / ``to_unrolled``) share one
parameter tree; splitting the layouts out would make ``Transformer`` and its relayout import each other.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from rag_jax import sharding
from rag_jax.model.attention import attend, attend_cache
from rag_jax.model.config import ModelConfig
from rag_jax.model.kv import DecodeCache, KVSegment
from rag_jax.model.masks import MASK_MODES, MaskSpec
from rag_jax.model.rope import rope_angles, rope_inv_freq, rotate

# Rematerialization (what the backward recomputes): "none" saves every activation, "full" recomputes each layer,
# "dots" saves every matmul output; the MaxText-style named choices save only the tagged projections
# (``checkpoint_name``) and recompute the rest: q/k/v, + attention output, + the MLP's gate/up outputs.
REMAT_NAMES = {"save_qkv_proj": ("qkv_proj",), "save_qkv_out_proj": ("qkv_proj", "out_proj"),
               "save_qkv_out_mlpwi": ("qkv_proj", "out_proj", "mlpwi")}
REMAT_POLICIES = ("none", "full", "dots", *REMAT_NAMES)
ACTIVATION_AXES = ("batch", "seq", "activation_embed")
MLP_CHUNK = 2048  # tokens per MLP call in long sequences (bounds the [b, s, intermediate] activations)


def _param(rngs: nnx.Rngs | None, shape, axes, dtype, init="normal") -> nnx.Param:
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _lora(cfg: ModelConfig, rngs: nnx.Rngs, name: str, in_features: int, out_features: int,
          in_axis: str | None) -> nnx.LoRA | None:
    """The ``nnx.LoRA`` adapter of projection ``name`` (``x [..., in] -> x @ lora_a @ lora_b [..., out]``;
    ``lora_a`` He-uniform, ``lora_b`` zeros: a new adapter changes nothing), or None where the config has none.
    Computed in the compute dtype; ``lora_a`` shards its input axis as the projection does, ``lora_b`` is
    replicated (it is small)."""
    if not cfg.lora_rank or name not in cfg.lora_targets:
        return None
    return nnx.LoRA(in_features, cfg.lora_rank, out_features, dtype=cfg.compute_dtype,
                    param_dtype=cfg.weight_dtype, rngs=rngs,
                    a_metadata={"out_sharding": (in_axis, None), "eager_sharding": False},
                    b_metadata={"out_sharding": (None, None), "eager_sharding": False})


def _adapted(lora: nnx.LoRA | None, x, y):
    """``y`` (a projection of ``x``) plus the adapter's ``lora(x)``, reshaped to ``y``'s shape."""
    if lora is None:
        return y
    flat = x.reshape(*x.shape[:2], -1)
    return y + lora(flat).reshape(y.shape).astype(y.dtype)


class RMSNorm(nnx.Module):
    """``x / rms(x) * scale`` with the statistics in float32 (as HF Llama)."""

    def __init__(self, dim: int, eps: float, param_dtype):
        self.scale = _param(None, (dim,), ("norm",), param_dtype, init="ones")
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return y.astype(x.dtype) * self.scale[...].astype(x.dtype)


class Attention(nnx.Module):
    """GQA projections; attention itself is ``attention.attend`` over rotated q/k."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd, h, d = cfg.weight_dtype, cfg.hidden_size, cfg.head_dim
        self.wq = _param(rngs, (h, cfg.num_heads, d), ("embed", "heads", "head_dim"), pd)
        self.wk = _param(rngs, (h, cfg.num_kv_heads, d), ("embed", "kv_heads", "head_dim"), pd)
        self.wv = _param(rngs, (h, cfg.num_kv_heads, d), ("embed", "kv_heads", "head_dim"), pd)
        self.wo = _param(rngs, (cfg.num_heads, d, h), ("heads", "head_dim", "embed"), pd)
        if cfg.qkv_bias:
            self.bq = _param(None, (cfg.num_heads, d), ("heads", "head_dim"), pd, init="zeros")
            self.bk = _param(None, (cfg.num_kv_heads, d), ("kv_heads", "head_dim"), pd, init="zeros")
            self.bv = _param(None, (cfg.num_kv_heads, d), ("kv_heads", "head_dim"), pd, init="zeros")
        if cfg.out_bias:
            self.bo = _param(None, (h,), ("embed",), pd, init="zeros")
        self.qkv_bias, self.out_bias = cfg.qkv_bias, cfg.out_bias
        nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d
        self.lora_wq = _lora(cfg, rngs, "wq", h, nq, "embed")
        self.lora_wk = _lora(cfg, rngs, "wk", h, nkv, "embed")
        self.lora_wv = _lora(cfg, rngs, "wv", h, nkv, "embed")
        self.lora_wo = _lora(cfg, rngs, "wo", nq, h, None)

    def project_qkv(self, x):
        """x ``[b, s, hidden]`` -> pre-RoPE q ``[b, s, num_heads, head_dim]``, k/v ``[b, s, num_kv_heads, head_dim]``."""
        dt = x.dtype
        q = _adapted(self.lora_wq, x, jnp.einsum("bsh,hnd->bsnd", x, self.wq[...].astype(dt)))
        k = _adapted(self.lora_wk, x, jnp.einsum("bsh,hnd->bsnd", x, self.wk[...].astype(dt)))
        v = _adapted(self.lora_wv, x, jnp.einsum("bsh,hnd->bsnd", x, self.wv[...].astype(dt)))
        if self.qkv_bias:
            q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
        return tuple(checkpoint_name(t, "qkv_proj") for t in (q, k, v))

    def output(self, attn_out):
        """``[b, s, num_heads, head_dim]`` -> ``[b, s, hidden]``."""
        out = _adapted(self.lora_wo, attn_out, jnp.einsum("bsnd,ndh->bsh", attn_out,
                                                           self.wo[...].astype(attn_out.dtype)))
        return checkpoint_name(out + self.bo[...].astype(out.dtype) if self.out_bias else out, "out_proj")


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd, h, m = cfg.weight_dtype, cfg.hidden_size, cfg.intermediate_size
        self.gate = _param(rngs, (h, m), ("embed", "mlp"), pd)
        self.up = _param(rngs, (h, m), ("embed", "mlp"), pd)
        self.down = _param(rngs, (m, h), ("mlp", "embed"), pd)
        if cfg.mlp_bias:  # Llama mlp_bias
            self.gate_bias = _param(None, (m,), ("mlp",), pd, init="zeros")
            self.up_bias = _param(None, (m,), ("mlp",), pd, init="zeros")
            self.down_bias = _param(None, (h,), ("embed",), pd, init="zeros")
        self.mlp_bias = cfg.mlp_bias
        self.lora_gate = _lora(cfg, rngs, "gate", h, m, "embed")
        self.lora_up = _lora(cfg, rngs, "up", h, m, "embed")
        self.lora_down = _lora(cfg, rngs, "down", m, h, "mlp")

    def __call__(self, x):
        """``x [b, s, hidden]`` -> ``[b, s, hidden]``; sequences longer than ``MLP_CHUNK`` tokens run in chunks
        of that many tokens (same values; the ``[b, s, intermediate]`` activations of a long prefill are never
        held at once)."""
        s = x.shape[1]
        if s <= MLP_CHUNK:
            return self._swiglu(x)
        return jnp.concatenate([self._swiglu(x[:, i:i + MLP_CHUNK]) for i in range(0, s, MLP_CHUNK)], axis=1)

    def _swiglu(self, x):
        dt = x.dtype
        bias = (lambda name: getattr(self, name)[...].astype(dt)) if self.mlp_bias else (lambda name: 0)
        g = checkpoint_name(_adapted(self.lora_gate, x, x @ self.gate[...].astype(dt)) + bias("gate_bias"), "mlpwi")
        u = checkpoint_name(_adapted(self.lora_up, x, x @ self.up[...].astype(dt)) + bias("up_bias"), "mlpwi")
        hidden = jax.nn.silu(g) * u
        return _adapted(self.lora_down, hidden, hidden @ self.down[...].astype(dt)) + bias("down_bias")


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.weight_dtype)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.weight_dtype)
        self.mlp = MLP(cfg, rngs)

    def qkv(self, x):
        """Attention inputs of hidden states ``x [b, s, hidden]``: pre-RoPE ``q [b, s, num_heads, head_dim]``,
        ``k``/``v [b, s, num_kv_heads, head_dim]`` of the normalized input."""
        return self.attn.project_qkv(self.input_norm(x))

    def finish(self, x, attn_out):
        """The block after attention: ``x + o_proj(attn_out)``, then ``+ mlp(norm(.))`` (pre-norm residuals).
        ``attn_out [b, s, num_heads, head_dim]`` -> ``[b, s, hidden]``. EM-LLM streaming calls ``qkv``, its
        own attention over memory, then this."""
        x = x + self.attn.output(attn_out)
        return x + self.mlp(self.post_attn_norm(x))

    def __call__(self, x, q_rope, k_rope, mask, cache_k=None, cache_v=None, *, impl: str = "auto"):
        """One pre-norm block; ``q_rope`` / ``k_rope`` the ``rope.rope_angles`` tables of the new tokens and of
        all attended keys (cache first), ``mask`` a ``MaskSpec`` (or dense bool mask), ``impl`` the attention
        implementation (``attention.attend``). Returns (x ``[b, s, hidden]``, (k, v) pre-RoPE of the new
        tokens)."""
        # Keep activations batch-sharded (a no-op outside a train step's mesh): without this hint XLA keeps
        # hidden states split like the weights and replicates them per chip (8B on v5p-64 does not fit).
        x = sharding.constrain(x, ACTIVATION_AXES)
        q, k, v = self.qkv(x)
        k_all, v_all = k, v
        if cache_k is not None:
            k_all = jnp.concatenate([cache_k.astype(k.dtype), k], axis=1)
            v_all = jnp.concatenate([cache_v.astype(v.dtype), v], axis=1)
        out = attend(rotate(q, *q_rope), rotate(k_all, *k_rope), v_all, mask, impl=impl)
        return sharding.constrain(self.finish(x, out), ACTIVATION_AXES), (k, v)


def _materialize(tree):
    """``tree`` computed once into buffers. XLA:CPU otherwise fuses the RoPE cos/sin into every layer's
    rotation and recomputes them per layer (3 of the 10 ms per SmolLM2 layer for 50 queries over 3,050
    cached keys), and it drops ``optimization_barrier``s before fusion. A conditional is a fusion boundary
    it keeps when it cannot fold the predicate: ``x == x`` on a float is False for NaN, so it stays (the
    tables of integer positions are finite: the identity branch always runs)."""
    leaf = jax.tree.leaves(tree)[0]
    keep = jnp.ravel(leaf)[0] == jnp.ravel(leaf)[0]
    return jax.lax.cond(keep, lambda t: t, lambda t: jax.tree.map(jnp.zeros_like, t), tree)


class ModelOutput(NamedTuple):
    logits: jnp.ndarray  # float32 [batch, seq, vocab]
    hidden: jnp.ndarray  # [batch, seq, hidden] after the final norm
    kv: KVSegment        # pre-RoPE KV of the new tokens


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_inputs(cfg: ModelConfig, tokens, positions, segment_ids, mode: str, is_global=None,
                 kv_cache: KVSegment | None = None) -> None:
    """Validate forward inputs before compute; raises ValueError/TypeError naming the field.

    Shape checks always run; value checks (token ids in ``[0, vocab_size)``, positions in
    ``[0, max_seq_len)`` for non-scaled RoPE) run on concrete arrays only.
    """
    if mode not in MASK_MODES:
        raise ValueError(f"mode={mode!r} is not supported; valid: {MASK_MODES}")
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq]; got shape {tuple(tokens.shape)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be an integer array; got dtype {tokens.dtype}")
    for name, arr in (("positions", positions), ("segment_ids", segment_ids), ("is_global", is_global)):
        if arr is not None and tuple(arr.shape) != tuple(tokens.shape):
            raise ValueError(f"{name} shape {tuple(arr.shape)} must equal tokens shape {tuple(tokens.shape)}")
    seq = tokens.shape[1]
    if seq > cfg.max_seq_len:
        raise ValueError(f"sequence length {seq} exceeds the model maximum max_seq_len={cfg.max_seq_len} tokens")
    if kv_cache is not None:
        expect = (cfg.num_layers, tokens.shape[0])
        if tuple(kv_cache.k.shape[:2]) != expect or kv_cache.k.shape[3:] != (cfg.num_kv_heads, cfg.head_dim):
            raise ValueError(f"kv_cache.k shape {tuple(kv_cache.k.shape)} does not match [num_layers={cfg.num_layers}, "
                             f"batch={tokens.shape[0]}, len, num_kv_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim}]")
    if _is_concrete(tokens) and tokens.size:
        host = np.asarray(tokens)  # NumPy reductions: also safe for NumPy constants inside a jit trace
        lo, hi = int(host.min()), int(host.max())
        if lo < 0 or hi >= cfg.vocab_size:
            bad = hi if hi >= cfg.vocab_size else lo
            raise ValueError(f"token id {bad} is outside the vocabulary [0, vocab_size={cfg.vocab_size})")


class Transformer(nnx.Module):
    """Decoder-only LM. See module docstring; shapes in ``__call__``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, remat_policy: str = "none"):
        if remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy={remat_policy!r}; valid: {REMAT_POLICIES}")
        self.config = cfg
        pd = cfg.weight_dtype
        self.embedding = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd)
        layers = [DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)]
        # Scanned: one DecoderLayer of stacked parameters (the same values as the unrolled stack of the seed).
        self.layers = _stack_layers(layers) if cfg.scan_layers else nnx.List(layers)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pd)
        self.remat_policy = remat_policy

    @property
    def inv_freq(self):
        cfg = self.config
        return rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def embed(self, tokens):
        """int ``[b, s]`` -> ``[b, s, hidden]`` in the compute dtype."""
        return jnp.take(self.embedding[...], tokens, axis=0).astype(self.config.compute_dtype)

    def head_weight(self):
        """The output projection ``[hidden, vocab]`` (the embedding transposed when tied)."""
        return self.embedding[...].T if self.config.tie_embeddings else self.lm_head[...]

    def logits(self, hidden):
        """``[b, s, hidden]`` (after final norm) -> float32 logits ``[b, s, vocab]``."""
        w = self.head_weight()
        return jnp.einsum("bsh,hv->bsv", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)

    def layer(self, i: int) -> DecoderLayer:
        """Decoder layer ``i`` (``0 <= i < num_layers``). Of a scanned stack this is a new module holding
        slices of the stacked parameters: read it (inside a jit the slice costs nothing stored); writes to it
        do not reach the model (``to_unrolled`` to edit layers one by one)."""
        if not self.config.scan_layers:
            return self.layers[i]
        graphdef, state = nnx.split(self.layers)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))

    def _remat(self, fn, *, scanned: bool):
        """``fn`` under this model's rematerialization policy (``REMAT_POLICIES``)."""
        if self.remat_policy == "none":
            return fn
        if self.remat_policy == "full":
            policy = None
        elif self.remat_policy == "dots":
            policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        else:
            policy = jax.checkpoint_policies.save_only_these_names(*REMAT_NAMES[self.remat_policy])
        # Under scan the body runs once per iteration anyway: CSE across iterations cannot happen (MaxText).
        return jax.checkpoint(fn, policy=policy, prevent_cse=False) if scanned else nnx.remat(fn, policy=policy)

    def __call__(self, tokens, positions, segment_ids, *, mode: str = "causal", is_global=None,
                 kv_cache: KVSegment | None = None, inputs_embeds=None) -> ModelOutput:
        """Forward pass.

        Args:
          tokens: int32 ``[batch, seq]`` token ids in ``[0, vocab_size)``.
          positions: int32 ``[batch, seq]`` RoPE positions.
          segment_ids: int32 ``[batch, seq]``; 0 = padding.
          mode: ``"causal" | "bidirectional" | "block"`` (see ``masks.build_mask``).
          is_global: bool ``[batch, seq]`` global tokens for ``block`` mode, or None.
          kv_cache: cached ``KVSegment`` attended before the new tokens, or None.
          inputs_embeds: ``[batch, seq, hidden]`` input of the first layer instead of the token embeddings
            (as HF ``inputs_embeds``), e.g. a frozen bottom's ``residual`` (``rag_jax.train.frozen_bottom``);
            ``tokens`` then only give the shape (and the targets to a loss).

        Returns:
          ``ModelOutput(logits float32 [b, s, vocab], hidden [b, s, hidden], kv KVSegment of the new tokens)``.

        Raises:
          ValueError / TypeError: see ``check_inputs``; ``inputs_embeds`` not ``[batch, seq, hidden]``.
        """
        x, kv = self.encode(tokens, positions, segment_ids, mode=mode, is_global=is_global, kv_cache=kv_cache,
                            inputs_embeds=inputs_embeds)
        hidden = self.final_norm(x)
        return ModelOutput(self.logits(hidden), hidden, kv)

    def encode(self, tokens, positions, segment_ids, *, mode: str = "causal", is_global=None,
               kv_cache: KVSegment | None = None, inputs_embeds=None) -> tuple[jax.Array, KVSegment]:
        """``(residual [batch, seq, hidden] before the final norm, KVSegment of the new tokens)``: ``__call__``
        without the norm and the output head (arguments as there), for a bottom model's output with its cache
        (``rag_jax.inference.block_prefix``)."""
        x, k, v = self._layers(tokens, positions, segment_ids, mode, is_global, kv_cache, inputs_embeds)
        return x, KVSegment(k=k, v=v, positions=positions.astype(jnp.int32),
                            segment_ids=segment_ids.astype(jnp.int32))

    def residual(self, tokens, positions, segment_ids, *, mode: str = "causal", is_global=None, inputs_embeds=None):
        """The residual stream after the last layer, before the final norm: ``[batch, seq, hidden]`` (compute
        dtype); arguments as ``__call__``. For a model of a checkpoint's first n layers this is the input of layer
        n (HF ``hidden_states[n]``), which a model of the remaining layers continues from as ``inputs_embeds``."""
        return self._layers(tokens, positions, segment_ids, mode, is_global, None, inputs_embeds)[0]

    def decode(self, tokens, positions, cache: DecodeCache, slot, attend=None) -> tuple[jax.Array, DecodeCache]:
        """New tokens written into ``cache`` from token slot ``slot`` on (empty in every row), attended with the
        whole cache in causal order (``attention.attend_cache``): one per row, or ``s`` consecutive ones (a
        speculative verification step checks ``s`` drafted tokens in one call). Args: ``tokens``, ``positions``
        int32 ``[batch]`` or ``[batch, s]``; ``cache`` a ``DecodeCache`` (``DecodeCache.from_segment`` of the
        prompt's KV plus empty slots); ``slot`` int32 scalar, the first slot written (every filled slot before it
        is attended); ``attend(layer, q, kt, vt, mask)`` in place of exact ``attend_cache`` (``magicpig``).
        Returns ``(logits float32 [batch, vocab] or [batch, s, vocab], the cache with the slots filled)``, the
        values of ``__call__`` on the tokens with the cache as a ``KVSegment``, without re-rotating it."""
        chunk = tokens.ndim == 2
        tokens, pos = (tokens, positions.astype(jnp.int32)) if chunk else (tokens[:, None], positions[:, None])
        batch, s = tokens.shape
        segment_ids = jax.lax.dynamic_update_slice_in_dim(cache.segment_ids, jnp.ones_like(pos), slot, axis=1)
        kv_pos = jax.lax.dynamic_update_slice_in_dim(cache.positions, pos.astype(jnp.int32), slot, axis=1)
        masks = self._layer_masks("causal", lambda w: MaskSpec.create(
            "causal", jnp.ones((batch, s), jnp.int32), segment_ids, q_order=jnp.broadcast_to(slot + jnp.arange(s), (batch, s)),
            q_positions=pos, kv_positions=kv_pos, sliding_window=w).dense())
        cos, sin = rope_angles(pos, self.inv_freq)
        x = self.embed(tokens)
        ks, vs = [], []
        for i, mask in enumerate(masks):
            layer = self.layer(i)
            q, k, v = layer.qkv(x)
            k, v = cache.write(i, rotate(k, cos, sin), v, slot)
            q = rotate(q, cos, sin)
            x = layer.finish(x, attend_cache(q, k, v, mask) if attend is None else attend(i, q, k, v, mask))
            ks.append(k)
            vs.append(v)
        logits = self.logits(self.final_norm(x))
        return (logits if chunk else logits[:, -1]), DecodeCache(k=tuple(ks), v=tuple(vs), positions=kv_pos,
                                                                 segment_ids=segment_ids)

    def _layer_groups(self, mode: str) -> list[tuple[int, int, int | None]]:
        """Runs of consecutive layers sharing one sliding window: ``[(start, stop, window)]`` (HF
        ``layer_types``); the embedding pass (``bidirectional``) sees the whole text: no window (GritLM note
        §3.2). A scanned stack runs one ``lax.scan`` per run."""
        cfg = self.config
        window = None if mode == "bidirectional" else cfg.sliding_window
        groups = []
        for i in range(cfg.num_layers):
            w = window and cfg.layer_window(i)
            if groups and groups[-1][2] == w:
                groups[-1] = (groups[-1][0], i + 1, w)
            else:
                groups.append((i, i + 1, w))
        return groups

    def _layer_masks(self, mode: str, make) -> list:
        """One mask per layer, ``make(window)`` called once per distinct sliding window."""
        made, masks = {}, []
        for start, stop, w in self._layer_groups(mode):
            if w not in made:
                made[w] = make(w)
            masks += [made[w]] * (stop - start)
        return masks

    def _layers(self, tokens, positions, segment_ids, mode, is_global, kv_cache, inputs_embeds):
        """Checks, masks, RoPE tables and the layer stack -> ``(x [b, s, hidden] before the final norm,
        k, v [num_layers, b, s, num_kv_heads, head_dim] pre-RoPE)``."""
        cfg = self.config
        check_inputs(cfg, tokens, positions, segment_ids, mode, is_global, kv_cache)
        if inputs_embeds is not None and tuple(inputs_embeds.shape) != (*tokens.shape, cfg.hidden_size):
            raise ValueError(f"inputs_embeds shape {tuple(inputs_embeds.shape)} must be [batch, seq, hidden] = "
                             f"{(*tokens.shape, cfg.hidden_size)}")
        positions = positions.astype(jnp.int32)
        segment_ids = segment_ids.astype(jnp.int32)
        if kv_cache is None:
            kv_seg, kv_pos = segment_ids, positions
        else:
            kv_seg = jnp.concatenate([kv_cache.segment_ids, segment_ids], axis=1)
            kv_pos = jnp.concatenate([kv_cache.positions, positions], axis=1)

        def make_mask(w):
            return MaskSpec.create(mode, segment_ids, kv_seg, q_is_global=is_global, q_positions=positions,
                                   kv_positions=kv_pos, sliding_window=w)
        q_rope = rope_angles(positions, self.inv_freq)  # once per forward, shared by the layers
        k_rope = q_rope if kv_cache is None else rope_angles(kv_pos, self.inv_freq)
        q_rope, k_rope = _materialize((q_rope, k_rope))
        x = self.embed(tokens) if inputs_embeds is None else inputs_embeds.astype(cfg.compute_dtype)
        impl = cfg.attention_impl
        if cfg.scan_layers:
            return self._scan_layers(x, q_rope, k_rope, mode, make_mask, kv_cache)
        run = self._remat(lambda layer, *args: layer(*args, impl=impl), scanned=False)
        ks, vs = [], []
        for i, (layer, mask) in enumerate(zip(self.layers, self._layer_masks(mode, make_mask))):
            cache = () if kv_cache is None else (kv_cache.k[i], kv_cache.v[i])
            x, (k, v) = run(layer, x, q_rope, k_rope, mask, *cache)
            ks.append(k)
            vs.append(v)
        return x, jnp.stack(ks), jnp.stack(vs)

    def _scan_layers(self, x, q_rope, k_rope, mode, make_mask, kv_cache):
        """The stacked layers as one ``jax.lax.scan`` per run of layers sharing a window (``_layers``)."""
        impl = self.config.attention_impl
        graphdef, state = nnx.split(self.layers)
        ks, vs = [], []
        groups = self._layer_groups(mode)
        for start, stop, window in groups:
            mask = make_mask(window)

            def body(x, xs, mask=mask):
                layer_state, cache = xs
                return nnx.merge(graphdef, layer_state)(x, q_rope, k_rope, mask, *cache, impl=impl)

            part = state if len(groups) == 1 else jax.tree.map(lambda a: a[start:stop], state)
            cache = () if kv_cache is None else (kv_cache.k[start:stop], kv_cache.v[start:stop])
            x, (k, v) = jax.lax.scan(self._remat(body, scanned=True), x, (part, cache))
            ks.append(k)
            vs.append(v)
        return x, jnp.concatenate(ks), jnp.concatenate(vs)


def _stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
    """One ``DecoderLayer`` whose every parameter holds ``layers``' values stacked on a new leading axis,
    named ``layers`` for sharding (``sharding.DEFAULT_RULES``: not split). Reuses ``layers[0]``'s object."""
    stacked = layers[0]
    values = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.to_pure_dict(nnx.state(layer)) for layer in layers])
    for path, var in list(nnx.iter_graph(stacked)):
        if isinstance(var, nnx.Param):
            value = values
            for key in path:
                value = value[key]
            var.set_value(value)
            var.set_metadata(out_sharding=("layers", *var.out_sharding))
    return stacked


def relayout_params(values: dict, num_layers: int, scan: bool) -> dict:
    """A pure parameter dict (``nnx.to_pure_dict``) of either layer layout in the layout ``scan`` asks for:
    ``layers: {i: {...}}`` (unrolled) <-> ``layers: {...}`` with a leading axis of ``num_layers`` (scanned)."""
    layers = values["layers"]
    stacked = not (0 in layers or "0" in layers)
    if stacked == scan:
        return values
    if scan:
        layers = jax.tree.map(lambda *xs: jnp.stack(xs), *[layers.get(i, layers.get(str(i))) for i in range(num_layers)])
    else:
        layers = {i: jax.tree.map(lambda a: a[i], layers) for i in range(num_layers)}
    return {**values, "layers": layers}


def _relayout(model: "Transformer", scan: bool) -> "Transformer":
    cfg = model.config
    if cfg.scan_layers == scan:
        return model
    abstract = nnx.eval_shape(lambda: Transformer(cfg.replace(scan_layers=scan), rngs=nnx.Rngs(0),
                                                  remat_policy=model.remat_policy))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, relayout_params(nnx.to_pure_dict(nnx.state(model)), cfg.num_layers, scan))
    return nnx.merge(graphdef, state)


def to_scanned(model: "Transformer") -> "Transformer":
    """``model`` with its layers stacked and scanned (``ModelConfig.scan_layers``): same values, a new module
    (``model`` itself is returned when it is scanned already)."""
    return _relayout(model, True)


def to_unrolled(model: "Transformer") -> "Transformer":
    """``model`` with one module per layer (``model.layers[i]``): the inverse of ``to_scanned``."""
    return _relayout(model, False)


def count_params(cfg: ModelConfig) -> int:
    """Number of parameters of ``Transformer(cfg)`` via ``jax.eval_shape`` (nothing allocated)."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    return int(sum(x.size for x in jax.tree.leaves(state)))


def jit_forward(model: Transformer):
    """A jitted functional forward over ``model``'s current parameters (``nnx.split`` once).

    Returns ``f(tokens, positions, segment_ids, *, mode="causal", is_global=None, kv_cache=None) -> ModelOutput``.
    Shape checks still run at trace time; token-id range checks need concrete inputs (call ``check_inputs``).
    """
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnames=("mode",))
    def fwd(state, tokens, positions, segment_ids, mode="causal", is_global=None, kv_cache=None):
        return nnx.merge(graphdef, state)(tokens, positions, segment_ids, mode=mode, is_global=is_global,
                                          kv_cache=kv_cache)

    def call(tokens, positions, segment_ids, *, mode="causal", is_global=None, kv_cache=None):
        return fwd(state, tokens, positions, segment_ids, mode=mode, is_global=is_global, kv_cache=kv_cache)

    return call
