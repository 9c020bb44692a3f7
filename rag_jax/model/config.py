"""Typed configuration of the Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2)."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

import jax.numpy as jnp

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Implementations ``model.attention.attend`` dispatches on.
ATTENTION_IMPLS = ("auto", "dense", "blockwise", "cudnn", "splash")
Precision = Literal["fp32", "bf16", "bf16_pure"]
PRECISIONS = ("fp32", "bf16", "bf16_pure")
# Projections a LoRA adapter can wrap (``ModelConfig.lora_targets``): attention q/k/v/o and the SwiGLU MLP's three.
LORA_TARGETS = ("wq", "wk", "wv", "wo", "gate", "up", "down")


class _HashableDict(dict):
    """A dict that hashes by content, so configs holding ``rope_scaling`` can be jit static arguments."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder.

    Attributes:
      vocab_size: number of token ids; ids must lie in ``[0, vocab_size)``.
      hidden_size: model width (tokens are embedded to ``[batch, seq, hidden_size]``).
      intermediate_size: SwiGLU MLP width.
      num_layers: decoder layers.
      num_heads: query heads.
      num_kv_heads: key/value heads (GQA); must divide ``num_heads``.
      head_dim: per-head width; ``None`` means ``hidden_size // num_heads``.
      rope_theta: RoPE base frequency.
      rope_scaling: ``None`` or a dict with ``rope_type`` in ``("default", "linear", "llama3")``;
        ``llama3`` needs ``factor``, ``low_freq_factor``, ``high_freq_factor``,
        ``original_max_position_embeddings`` (Llama 3.1 release); ``linear`` needs ``factor``.
      rms_norm_eps: RMSNorm epsilon.
      max_seq_len: the longest sequence (in tokens) the model accepts in one forward pass.
      tie_embeddings: share the input embedding with the output projection.
      qkv_bias: biases on the q/k/v projections (Qwen2; Llama ``attention_bias``).
      out_bias: a bias on the attention output projection (Llama ``attention_bias``).
      mlp_bias: biases on the three MLP projections (Llama ``mlp_bias``).
      sliding_window: sliding attention window in tokens, or ``None``.
      layer_types: ``None`` (the window, if any, applies to every layer, as Mistral) or one entry per layer,
        ``"full_attention"`` or ``"sliding_attention"`` (HF ``layer_types``; Qwen2 ``max_window_layers``).
      dtype: compute dtype of activations and matmuls.
      param_dtype: storage dtype of parameters.
      attention_impl: ``"auto" | "dense" | "blockwise" | "cudnn" | "splash"`` (``model.attention``):
        ``auto`` picks cuDNN on GPU, splash on TPU, dense or blockwise on CPU by length; ``dense`` is
        the reference. Not part of the architecture (``fingerprint`` ignores it).
      lora_rank: rank of the LoRA adapters (Hu et al., ICLR 2022; ``flax.nnx.LoRA``) added beside the
        ``lora_targets`` projections of every layer (``y = x W + x A B``, ``A [in, r]``, ``B [r, out]`` zero at
        init so the model starts as its base); 0 = none. ``model.lora.add_lora`` / ``merge_lora`` convert.
      lora_targets: which projections carry adapters, a subset of ``LORA_TARGETS``.
      scan_layers: store the decoder layers stacked (every parameter gains a leading ``layers`` axis) and run
        them with one ``jax.lax.scan`` per run of layers sharing a sliding window, so compile time and program
        size stay flat in depth (MaxText's ``scan_layers``; research note jax_frameworks.md). Same values as
        the unrolled stack; a storage layout, not architecture (``fingerprint`` ignores it;
        ``transformer.to_scanned`` / ``to_unrolled`` convert a model).
    """

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention_impl: str = "auto"
    scan_layers: bool = False
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            divisors = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}; "
                             f"use one of {divisors}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                                 "set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in SUPPORTED_DTYPES:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; valid: {SUPPORTED_DTYPES}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"ModelConfig.attention_impl={self.attention_impl!r} is not supported; "
                             f"valid: {ATTENTION_IMPLS}")
        if not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool) or self.lora_rank < 0:
            raise ValueError(f"ModelConfig.lora_rank={self.lora_rank!r} must be an integer >= 0 (0 = no adapters)")
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        bad = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if bad or not self.lora_targets:
            raise ValueError(f"ModelConfig.lora_targets={list(self.lora_targets)} must be a non-empty subset of "
                             f"{list(LORA_TARGETS)}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"ModelConfig.scan_layers={self.scan_layers!r} must be true or false")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta={self.rope_theta} must be > 0")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be None or >= 1 tokens")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad or len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types={list(self.layer_types)} must list num_layers={self.num_layers} "
                                 f"entries from {LAYER_TYPES}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", _HashableDict(self.rope_scaling))
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported; "
                                 f"valid: {SUPPORTED_ROPE_TYPES}")

    def __repr__(self) -> str:
        """The dataclass repr, without the LoRA fields when there are no adapters: the repr is part of cache keys
        (``kv_store.model_fingerprint``), which stay those of configs from before adapters existed."""
        shown = [f for f in dataclasses.fields(self) if self.lora_rank or f.name not in ("lora_rank", "lora_targets")]
        return f"{type(self).__qualname__}({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` in tokens, or ``None`` (full attention)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self):
        return jnp.dtype(self.param_dtype)

    # ``preset: <name>`` in a config section of this class (``rag_jax.config.from_dict``); set below PRESETS
    CONFIG_PRESETS: typing.ClassVar[dict[str, dict[str, Any]]]

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """A stable string identifying the architecture (for cache keys)."""
        skip = ("attention_impl", "scan_layers") + (() if self.lora_rank else ("lora_rank", "lora_targets"))
        arch = {k: v for k, v in self.to_dict().items() if k not in skip}  # without adapters: as before they existed
        return repr(sorted(arch.items()))

    @classmethod
    def tiny(cls, **overrides) -> "ModelConfig":
        """A small config for tests and CPU smoke runs."""
        return cls(**{**PRESETS["tiny"], **overrides})

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; valid: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, max_seq_len=1024),
    "cpu-small": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                      num_kv_heads=2, max_seq_len=2048),
    # SmolLM2-135M's shape (random weights: benchmarks where the GGUF cannot travel, e.g. to a lent device).
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True,
                         rms_norm_eps=1e-5),
    # Llama 3.2 1B (tied embeddings, Llama-3.1 RoPE scaling).
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                        num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
                        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=8192),
                        max_seq_len=131072, tie_embeddings=True, rms_norm_eps=1e-5),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, rope_theta=500000.0, max_seq_len=8192, rms_norm_eps=1e-5),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                       num_heads=64, num_kv_heads=8, rope_theta=500000.0, max_seq_len=8192, rms_norm_eps=1e-5),
}


ModelConfig.CONFIG_PRESETS = PRESETS


def apply_precision(cfg: ModelConfig, precision: str) -> ModelConfig:
    """The run setting ``train.precision`` as model dtypes. ``fp32``: all float32. ``bf16``: bfloat16
    compute, float32 master params and optimizer state. ``bf16_pure``: bfloat16 params and optimizer state
    too (halves memory, loses small updates). Raises ValueError naming the valid settings."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; valid: {PRECISIONS}")
    dtype, param_dtype = {"fp32": ("float32", "float32"), "bf16": ("bfloat16", "float32"),
                          "bf16_pure": ("bfloat16", "bfloat16")}[precision]
    return cfg.replace(dtype=dtype, param_dtype=param_dtype)
