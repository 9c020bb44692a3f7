"""Import and export HF-format checkpoints (``config.json`` + ``*.safetensors``) from a local folder.

Supported architectures: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``.
Our parameters keep HF's layout (``rotate_half`` RoPE, unscaled queries), so conversion is one table
of names plus reshapes/transposes (``_tensor_map``). Nothing is ever fetched from a hub.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from rag_jax.atomic import recover, replace_directory
from rag_jax.file_errors import naming, one_line
from rag_jax.model.config import SUPPORTED_ROPE_TYPES, ModelConfig
from rag_jax.model.lora import merge_lora
from rag_jax.model.transformer import Transformer, to_scanned, to_unrolled

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


# Config fields that change the math, with the values rag-jax implements (anything else is refused by name).
_IMPLEMENTED_VALUES = {"hidden_act": ("silu",), "pretraining_tp": (1,), "attn_logit_softcapping": (None,),
                       "final_logit_softcapping": (None,), "partial_rotary_factor": (1, 1.0, None)}


def _refuse(field: str, value, valid) -> ValueError:
    return ValueError(f"config field {field}={value!r} is not implemented by rag-jax; valid: {valid}")


def _layer_types(hf: dict, arch: str, sliding: int | None) -> tuple[str, ...] | None:
    """Per-layer attention kinds as transformers derives them (``layer_types``, else Qwen2's
    ``max_window_layers``: layers ``i >= max_window_layers`` use the window), or None (all layers alike)."""
    n = hf["num_hidden_layers"]
    if hf.get("layer_types") is not None:
        return tuple(hf["layer_types"])
    if arch == "Qwen2ForCausalLM" and sliding is not None:
        first = hf.get("max_window_layers", 28)
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))
    return None


_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_SIZE_FIELDS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window",
                         "max_window_layers")
_MAX_SIZE = 2**31  # beyond any real checkpoint; keeps a forged size from building giant name tables


def _check_fields(hf: dict) -> None:
    """Types and ranges of the ``config.json`` fields ``config_from_hf`` reads; ValueError naming the field."""
    def bad(field, value, valid):
        return ValueError(f"config field {field}={value!r:.60} is malformed; valid: {valid}")

    for field in _SIZE_FIELDS + _OPTIONAL_SIZE_FIELDS:
        value = hf.get(field)
        if value is None:
            if field in _SIZE_FIELDS:
                raise ValueError(f"config field {field} is missing")
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_SIZE:
            raise bad(field, value, f"an int in [0, {_MAX_SIZE})")
    for field in ("rope_theta", "rms_norm_eps"):
        value = hf.get(field, 1.0)
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < 0):
            raise bad(field, value, "a finite number >= 0")
    archs = hf.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise bad("architectures", archs, "a list of str")
    for field in ("rope_parameters", "rope_scaling"):
        if hf.get(field) is not None and not isinstance(hf[field], dict):
            raise bad(field, hf[field], "an object or null")
        for key in ("rope_theta", "factor"):
            if key not in (hf.get(field) or {}):
                continue
            value = hf[field][key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise bad(f"{field}.{key}", value, "a finite number > 0")
    types = hf.get("layer_types")
    if types is not None and (not isinstance(types, list) or not all(isinstance(t, str) for t in types)):
        raise bad("layer_types", types, "a list of str")


def config_from_hf(hf: dict) -> tuple[ModelConfig, str]:
    """``config.json`` dict -> (ModelConfig, architecture).

    Raises ValueError for unsupported architectures and for every field that changes the math in a way
    rag-jax does not implement (names the field, its value and the valid values): ``hidden_act``, RoPE
    types other than default/linear/llama3, ``partial_rotary_factor``, softcapping, ``pretraining_tp``.
    Implemented: ``attention_bias`` (q/k/v/o biases), ``mlp_bias``, ``sliding_window`` with per-layer
    ``layer_types`` / Qwen2 ``use_sliding_window`` + ``max_window_layers``, tied embeddings.
    """
    _check_fields(hf)
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else {v: k for k, v in _MODEL_TYPES.items()}.get(hf.get("model_type"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {arch or hf.get('model_type')!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    fields = {**hf, **{k: v for k, v in rope.items() if k == "partial_rotary_factor"}}
    for field, valid in _IMPLEMENTED_VALUES.items():
        if fields.get(field, valid[0]) not in valid:
            raise _refuse(field, fields[field], list(valid))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _refuse("rope_type", rope_type, list(SUPPORTED_ROPE_TYPES))
    rope_scaling = None if rope_type == "default" else rope
    sliding = hf.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not hf.get("use_sliding_window", False):
        sliding = None
    if arch == "LlamaForCausalLM":
        sliding = None  # Llama has no window; its config.json may still carry one
    bias = arch == "LlamaForCausalLM" and bool(hf.get("attention_bias", False))
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"], head_dim=hf.get("head_dim"),
        rope_theta=float(rope_theta), rope_scaling=rope_scaling, rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        max_seq_len=hf.get("max_position_embeddings", 2048), tie_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=arch == "Qwen2ForCausalLM" or bias, out_bias=bias,
        mlp_bias=arch == "LlamaForCausalLM" and bool(hf.get("mlp_bias", False)), sliding_window=sliding,
        layer_types=_layer_types(hf, arch, sliding) if sliding is not None else None)
    return cfg, arch


def config_to_hf(cfg: ModelConfig, arch: str) -> dict:
    """ModelConfig -> ``config.json`` dict for ``arch`` (every field transformers needs for the same math).

    Raises ValueError for an unsupported ``arch`` or a config ``arch`` cannot express (biases, windows).
    """
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
    expressible = {"LlamaForCausalLM": (cfg.qkv_bias == cfg.out_bias and cfg.sliding_window is None),
                   "MistralForCausalLM": not (cfg.qkv_bias or cfg.out_bias or cfg.mlp_bias or cfg.layer_types),
                   "Qwen2ForCausalLM": cfg.qkv_bias and not (cfg.out_bias or cfg.mlp_bias)}[arch]
    if not expressible:
        raise ValueError(f"architecture {arch!r} cannot express qkv_bias={cfg.qkv_bias}, out_bias={cfg.out_bias}, "
                         f"mlp_bias={cfg.mlp_bias}, sliding_window={cfg.sliding_window}, "
                         f"layer_types={cfg.layer_types}; pick another architecture")
    if arch == "LlamaForCausalLM":
        out.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    if arch == "MistralForCausalLM":
        out["sliding_window"] = cfg.sliding_window
    if arch == "Qwen2ForCausalLM":
        out["use_sliding_window"] = cfg.sliding_window is not None
        out["sliding_window"] = cfg.sliding_window
        out["max_window_layers"] = cfg.num_layers
        if cfg.sliding_window is not None:
            out["layer_types"] = list(cfg.layer_types or ["sliding_attention"] * cfg.num_layers)
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
        if cfg.out_bias:
            table[L + ("attn", "bo")] = (p + "self_attn.o_proj.bias", same, same)
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            table[L + ("mlp", ours)] = (p + f"mlp.{theirs}.weight", t, t)
            if cfg.mlp_bias:
                table[L + ("mlp", f"{ours}_bias")] = (p + f"mlp.{theirs}.bias", same, same)
    return table


@contextlib.contextmanager
def _readable(file: Path):
    """safetensors' header errors (``SafetensorError``: too large, bad JSON, offsets outside the file) as a
    one-line ValueError naming the file."""
    try:
        yield
    except SafetensorError as e:
        raise ValueError(f"{file} is not a readable safetensors file ({one_line(e, 200)})") from None


def _safetensors_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> file holding it (single file or sharded with ``model.safetensors.index.json``)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        with naming(index):
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError("weight_map must map tensor names to file names")
        missing = sorted({f for f in weight_map.values() if not (path / f).exists()})
        if missing:
            raise FileNotFoundError(f"{index} lists safetensors files that are missing: {missing}")
        return {name: path / f for name, f in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file (or model.safetensors.index.json) in {path}")
    out = {}
    for f in files:
        with _readable(f), safe_open(f, framework="flax") as fh:
            for name in fh.keys():
                if name in out:
                    raise ValueError(f"tensor {name!r} is in both {out[name].name} and {f.name} and {path} has no "
                                     "model.safetensors.index.json to say which one is meant")
                out[name] = f
    return out


def build_model(cfg: ModelConfig, names: set[str] | dict, get_tensor: Callable[[str], np.ndarray],
                source: str) -> Transformer:
    """A ``Transformer(cfg)`` filled from tensors in HF layout and naming (``model.layers.0.self_attn.q_proj.weight``).

    Args:
      names: every tensor name the checkpoint holds; each must be used (a tied checkpoint may repeat the
        embedding as an identical ``lm_head.weight``; ``rotary_emb.inv_freq`` buffers are derived, skipped).
      get_tensor: name -> array (NumPy or JAX) in HF layout.
      source: where the tensors come from, for error messages.

    Raises ValueError naming the tensor: missing, shape not matching the config, or not used.
    """
    abstract = nnx.eval_shape(lambda: Transformer(cfg.replace(scan_layers=False), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    table = _tensor_map(cfg)
    flat = []
    for key, var in nnx.to_flat_state(state):
        if key not in table:
            raise ValueError(f"internal: no HF mapping for parameter {key}")
        name, to_ours, _ = table[key]
        if name not in names:
            raise ValueError(f"tensor {name!r} is missing from {source}")
        hf_tensor = get_tensor(name)
        try:
            value = to_ours(hf_tensor)
        except (TypeError, ValueError):
            value = None
        if value is None or tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(hf_tensor.shape)}, which does not match "
                             f"the config (expected parameter {'.'.join(map(str, key))} of shape {tuple(var.shape)})")
        flat.append((key, var.replace(value=jnp.asarray(value, cfg.weight_dtype))))
    used = {name for name, _, _ in table.values()}
    unused = sorted(n for n in names if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if unused == ["lm_head.weight"] and cfg.tie_embeddings:
        head, embedding = get_tensor("lm_head.weight"), get_tensor("model.embed_tokens.weight")
        if np.array_equal(np.asarray(head), np.asarray(embedding)):
            unused = []
    if unused:
        raise ValueError(f"{source} holds {len(unused)} tensor(s) this config does not use, e.g. {unused[:3]}; "
                         "rag-jax refuses to drop weights (check the config: biases, tied embeddings, architecture)")
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return to_scanned(model) if cfg.scan_layers else model


def load_hf(path: str | os.PathLike, *, dtype: str | None = None) -> tuple[ModelConfig, Transformer, str]:
    """Load an HF checkpoint folder into a ``Transformer``.

    Args:
      path: local folder with ``config.json`` and ``*.safetensors``.
      dtype: override the parameter dtype (``"float32"``, ``"bfloat16"``); default: as stored in the config
        (``float32`` when absent).

    Returns: ``(config, model, architecture)``.
    Raises:
      FileNotFoundError: missing folder, ``config.json`` or safetensors file.
      ValueError: unsupported architecture or config field (see ``config_from_hf``); a tensor missing, unused,
        held by two files without an index, or its shape not matching the config (names the tensor).
    """
    path = Path(path)
    recover(path)  # finish or undo a save_hf that was killed mid-swap
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path / 'config.json'} not found (expected an HF checkpoint folder)")
    with naming(path / "config.json"):
        hf_cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
        if not isinstance(hf_cfg, dict):
            raise ValueError(f"must hold a JSON object; got {type(hf_cfg).__name__}")
        cfg, arch = config_from_hf(hf_cfg)
    stored = hf_cfg.get("torch_dtype") or hf_cfg.get("dtype") or "float32"
    param_dtype = dtype or (stored if stored in ("float32", "bfloat16", "float16") else "float32")
    cfg = cfg.replace(param_dtype=param_dtype, dtype="float32" if param_dtype == "float32" else param_dtype)
    files = _safetensors_files(path)
    if cfg.num_layers > len(files):
        raise ValueError(f"{path / 'config.json'}: num_hidden_layers={cfg.num_layers} but the safetensors files "
                         f"hold {len(files)} tensors")

    def get_tensor(name):
        # Open per tensor: the file's mapped pages leave the RSS once each tensor is copied out, so a load
        # peaks at about the weights plus one tensor, not the weights twice (issue 15's memory budget).
        with _readable(files[name]), safe_open(files[name], framework="flax") as f:
            return f.get_tensor(name)

    model = build_model(cfg, files, get_tensor, f"the safetensors files in {path} (against its config.json)")
    return cfg, model, arch


HF_KIND = "rag_jax.hf_model"


def save_hf(model: Transformer, path: str | os.PathLike, arch: str = "LlamaForCausalLM", *,
            max_shard_bytes: int = 2 * 1024**3, extra_files: dict[str, str] | None = None,
            overwrite: bool = False) -> Path:
    """Export ``model`` as an HF checkpoint folder (atomically: written to a temp folder, then renamed).

    ``extra_files`` (file name -> text) are written into the same folder in the same atomic step
    (``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``).
    ``rag_jax.atomic.replace_directory`` rules: an earlier export at ``path`` is replaced; a folder with
    other files (or another rag_jax artifact unless ``overwrite``) raises ``TargetExistsError``.

    LoRA adapters (``ModelConfig.lora_rank``) are folded into their weights (``lora.merge_lora``).

    Tensors larger than ``max_shard_bytes`` in total are split across ``model-0000i-of-0000n.safetensors``
    files with a ``model.safetensors.index.json``. Raises ValueError for unsupported ``arch``.
    """
    _check_arch(arch)
    model = merge_lora(to_unrolled(model))     # HF folders hold plain weights: adapters are folded in
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
        for fname, text in (extra_files or {}).items():
            (tmp / fname).write_text(text)
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
