"""Import and export HF-format checkpoints (``config.json`` + ``*.safetensors``) from a local folder.

Supported architectures: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``.
Our parameters keep HF's layout (``rotate_half`` RoPE, unscaled queries), so conversion is one table
of names plus reshapes/transposes (``_tensor_map``). Nothing is ever fetched from a hub.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.flax import save_file

from rag_jax.atomic import recover, replace_directory
from rag_jax.model.config import ModelConfig
from rag_jax.model.transformer import Transformer

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


def config_from_hf(hf: dict) -> tuple[ModelConfig, str]:
    """``config.json`` dict -> (ModelConfig, architecture). Raises ValueError for unsupported architectures."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else {v: k for k, v in _MODEL_TYPES.items()}.get(hf.get("model_type"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {arch or hf.get('model_type')!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_scaling = None if rope_type == "default" else rope
    sliding = hf.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not hf.get("use_sliding_window", False):
        sliding = None
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"], head_dim=hf.get("head_dim"),
        rope_theta=float(rope_theta), rope_scaling=rope_scaling, rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        max_seq_len=hf.get("max_position_embeddings", 2048), tie_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)), sliding_window=sliding)
    return cfg, arch


def config_to_hf(cfg: ModelConfig, arch: str) -> dict:
    """ModelConfig -> ``config.json`` dict for ``arch``."""
    _check_arch(arch)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    out = dict(architectures=[arch], model_type=_MODEL_TYPES[arch], vocab_size=cfg.vocab_size,
               hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
               num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
               num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
               max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_norm_eps,
               tie_word_embeddings=cfg.tie_embeddings, rope_parameters=rope, rope_theta=cfg.rope_theta,
               torch_dtype=cfg.param_dtype, dtype=cfg.param_dtype)
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    if arch == "LlamaForCausalLM":
        out["attention_bias"] = cfg.qkv_bias
    if arch == "MistralForCausalLM":
        out["sliding_window"] = cfg.sliding_window
    if arch == "Qwen2ForCausalLM":
        out["use_sliding_window"] = cfg.sliding_window is not None
        out["sliding_window"] = cfg.sliding_window
    return out


def _check_arch(arch: str):
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


Transform = Callable[[jnp.ndarray], jnp.ndarray]


def _tensor_map(cfg: ModelConfig) -> dict[tuple, tuple[str, Transform, Transform]]:
    """Our parameter path -> (HF tensor name, hf->ours, ours->hf)."""
    h, d, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    t = lambda x: x.T  # noqa: E731  [out, in] <-> [in, out]
    same = lambda x: x  # noqa: E731

    def proj(n):  # [n*d, h] <-> [h, n, d]
        return (lambda x: x.T.reshape(h, n, d)), (lambda x: x.reshape(h, n * d).T)

    def bias(n):
        return (lambda x: x.reshape(n, d)), (lambda x: x.reshape(n * d))

    table = {("embedding",): ("model.embed_tokens.weight", same, same),
             ("final_norm", "scale"): ("model.norm.weight", same, same)}
    if not cfg.tie_embeddings:
        table[("lm_head",)] = ("lm_head.weight", t, t)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        L = ("layers", i)
        table[L + ("input_norm", "scale")] = (p + "input_layernorm.weight", same, same)
        table[L + ("post_attn_norm", "scale")] = (p + "post_attention_layernorm.weight", same, same)
        table[L + ("attn", "wq")] = (p + "self_attn.q_proj.weight", *proj(nh))
        table[L + ("attn", "wk")] = (p + "self_attn.k_proj.weight", *proj(nkv))
        table[L + ("attn", "wv")] = (p + "self_attn.v_proj.weight", *proj(nkv))
        table[L + ("attn", "wo")] = (p + "self_attn.o_proj.weight",
                                     lambda x: x.T.reshape(nh, d, h), lambda x: x.reshape(nh * d, h).T)
        if cfg.qkv_bias:
            table[L + ("attn", "bq")] = (p + "self_attn.q_proj.bias", *bias(nh))
            table[L + ("attn", "bk")] = (p + "self_attn.k_proj.bias", *bias(nkv))
            table[L + ("attn", "bv")] = (p + "self_attn.v_proj.bias", *bias(nkv))
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            table[L + ("mlp", ours)] = (p + f"mlp.{theirs}.weight", t, t)
    return table


def _safetensors_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> file holding it (single file or sharded with ``model.safetensors.index.json``)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (path / f).exists()})
        if missing:
            raise FileNotFoundError(f"{index} lists safetensors files that are missing: {missing}")
        return {name: path / f for name, f in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file (or model.safetensors.index.json) in {path}")
    out = {}
    for f in files:
        with safe_open(f, framework="flax") as fh:
            out.update({name: f for name in fh.keys()})
    return out


def load_hf(path: str | os.PathLike, *, dtype: str | None = None) -> tuple[ModelConfig, Transformer, str]:
    """Load an HF checkpoint folder into a ``Transformer``.

    Args:
      path: local folder with ``config.json`` and ``*.safetensors``.
      dtype: override the parameter dtype (``"float32"``, ``"bfloat16"``); default: as stored in the config
        (``float32`` when absent).

    Returns: ``(config, model, architecture)``.
    Raises:
      FileNotFoundError: missing folder, ``config.json`` or safetensors file.
      ValueError: unsupported architecture; a tensor missing, or its shape not matching the config
        (names the tensor and both shapes).
    """
    path = Path(path)
    recover(path)  # finish or undo a save_hf that was killed mid-swap
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path / 'config.json'} not found (expected an HF checkpoint folder)")
    hf_cfg = json.loads((path / "config.json").read_text())
    cfg, arch = config_from_hf(hf_cfg)
    stored = hf_cfg.get("torch_dtype") or hf_cfg.get("dtype") or "float32"
    param_dtype = dtype or (stored if stored in ("float32", "bfloat16", "float16") else "float32")
    cfg = cfg.replace(param_dtype=param_dtype, dtype="float32" if param_dtype == "float32" else param_dtype)
    files = _safetensors_files(path)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    table = _tensor_map(cfg)
    handles = {}
    flat = []
    try:
        for key, var in nnx.to_flat_state(state):
            if key not in table:
                raise ValueError(f"internal: no HF mapping for parameter {key}")
            name, to_ours, _ = table[key]
            if name not in files:
                raise ValueError(f"tensor {name!r} is missing from the safetensors files in {path}")
            f = files[name]
            if f not in handles:
                handles[f] = safe_open(f, framework="flax").__enter__()
            hf_tensor = handles[f].get_tensor(name)
            try:
                value = to_ours(hf_tensor)
            except (TypeError, ValueError):
                value = None
            if value is None or tuple(value.shape) != tuple(var.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(hf_tensor.shape)}, which does not match the "
                                 f"config (expected parameter {'.'.join(map(str, key))} of shape {tuple(var.shape)})")
            flat.append((key, var.replace(value=jnp.asarray(value, cfg.weight_dtype))))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return cfg, model, arch


HF_KIND = "rag_jax.hf_model"


def save_hf(model: Transformer, path: str | os.PathLike, arch: str = "LlamaForCausalLM", *,
            max_shard_bytes: int = 2 * 1024**3, overwrite: bool = False) -> Path:
    """Export ``model`` as an HF checkpoint folder (atomically: written to a temp folder, then renamed).

    ``rag_jax.atomic.replace_directory`` rules: an earlier export at ``path`` is replaced; a folder with
    other files (or another rag_jax artifact unless ``overwrite``) raises ``TargetExistsError``.

    Tensors larger than ``max_shard_bytes`` in total are split across ``model-0000i-of-0000n.safetensors``
    files with a ``model.safetensors.index.json``. Raises ValueError for unsupported ``arch``.
    """
    _check_arch(arch)
    cfg = model.config
    path = Path(path)
    table = _tensor_map(cfg)
    tensors = {}
    for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, _, to_hf = table[key]
        tensors[name] = jnp.asarray(to_hf(var[...]))
    shards: list[dict] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].size * tensors[name].dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    with replace_directory(path, HF_KIND, overwrite=overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(config_to_hf(cfg, arch), indent=2))
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({n: fname for n in shard})
            total = sum(t.size * t.dtype.itemsize for t in tensors.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": int(total)}, "weight_map": weight_map}, indent=2))
    return path


def params_equal(a: Transformer, b: Transformer) -> bool:
    """True iff both models hold bit-identical parameters (same tree, shapes, dtypes, values)."""
    sa, sb = nnx.state(a, nnx.Param), nnx.state(b, nnx.Param)
    la, lb = jax.tree.leaves(sa), jax.tree.leaves(sb)
    return (jax.tree.structure(sa) == jax.tree.structure(sb)
            and all(x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)))
