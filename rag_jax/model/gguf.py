"""Import GGUF files (llama.cpp's format): model, tokenizer and chat template, with nothing downloaded.

Read with the ``gguf`` package (``GGUFReader``), dequantized with ``gguf.quants.dequantize`` (every type it
supports: F32/F16/BF16, Q4_0 ... Q8_0, K-quants, IQ*). Tensors are renamed to HF names with ``gguf``'s own
``TensorNameMap`` and handed to ``hf.build_model``, so the HF importer's checks (every tensor used, shapes)
apply unchanged. llama.cpp's converter permutes the q/k rows of ``llama`` checkpoints for its interleaved
RoPE (``convert_hf_to_gguf.py``, ``LlamaModel.permute``); ``_unpermute`` undoes it. ``qwen2`` files keep HF order.

The tokenizer is rebuilt with ``tokenizers`` from ``tokenizer.ggml.*`` (byte-level BPE, ``gpt2`` model):
vocabulary and merges as stored, the pre-tokenizer named by ``tokenizer.ggml.pre`` (llama.cpp's
``llama-vocab.cpp`` regexes), control tokens as special tokens.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from rag_jax.file_errors import naming, one_line
from rag_jax.model.config import ModelConfig
from rag_jax.model.hf import build_model, config_from_hf, save_hf
from rag_jax.model.transformer import Transformer

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# llama.cpp's pre-tokenizer regexes per ``tokenizer.ggml.pre`` (llama-vocab.cpp); ByteLevel follows.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZERS = {"gpt2": [_GPT2], "default": [_GPT2], "smollm": [r"\p{N}", _GPT2], "llama-bpe": [_LLAMA3],
                  "llama3": [_LLAMA3], "qwen2": [_QWEN2], "deepseek-r1-qwen": [_QWEN2]}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp LLAMA_TOKEN_TYPE_*)


@dataclasses.dataclass
class GGUFFile:
    """An opened GGUF file: ``metadata`` (key -> Python value) and ``tensors`` (name -> ``ReaderTensor``)."""

    path: Path
    metadata: dict
    tensors: dict

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{self.path}: GGUF metadata general.architecture={arch!r:.60} must be a str")
        return arch

    def get(self, key: str, default=None):
        """``{arch}.key`` when the key starts with ``.``, else the key as given."""
        return self.metadata.get(self.architecture + key if key.startswith(".") else key, default)


# Smallest encodings (bytes) of a metadata entry (key length, key, type, a 1-byte value) and of a tensor info
# (name length, name, n_dims, one dim, type, offset): counts that cannot fit in the file are malformed.
_MIN_KV_BYTES, _MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 1, 8 + 1 + 4 + 8 + 4 + 8


def _check_header(path: Path) -> None:
    """Magic, version and the two counts, before ``GGUFReader`` loops over them (a forged count of 2**63
    must be an error, not a long loop). Raises ValueError naming the file and the field."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (magic {head[:4]!r}, {size} bytes; expected b'GGUF' and a "
                         "24-byte header)")
    version = int.from_bytes(head[4:8], "little")
    tensors, kvs = int.from_bytes(head[8:16], "little"), int.from_bytes(head[16:24], "little")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF header version={version} is not supported; valid: [2, 3] "
                         "(little-endian)")
    room = size - 24
    if kvs * _MIN_KV_BYTES > room or tensors * _MIN_TENSOR_INFO_BYTES > room:
        raise ValueError(f"{path}: GGUF header counts (tensor_count={tensors}, kv_count={kvs}) do not fit in the "
                         f"file's {size} bytes")


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Memory-map a GGUF file and read its metadata and tensor infos (no tensor data).

    Raises:
      FileNotFoundError: no such file.
      ValueError: one line naming the file: bad magic, version or counts, metadata or tensor infos that run
        past the end of the file or have unknown types, a tensor whose data lies outside the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found")
    _check_header(path)
    # the field names are a hint only: gguf's private hook, so fall back to the plain reader without it
    reader_cls = _TracingReader if hasattr(gguf.GGUFReader, "_push_field") else gguf.GGUFReader
    last = _TracingReader.last_field = [None]
    try:
        reader = reader_cls(path)
        metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        tensors = {t.name: t for t in reader.tensors}
    except Exception as e:  # gguf's reader raises whatever numpy does on a truncated/forged field
        where = f" after field {last[0]!r}" if last[0] else ""
        if isinstance(e, (IndexError, TypeError)) or "divisor" in str(e) or "reshape" in str(e):
            reason = "a metadata entry or tensor info runs past the end of the file (a forged length or count)"
        elif isinstance(e, UnicodeDecodeError):
            reason = "a metadata key or string is not UTF-8"
        else:
            reason = one_line(e, 160)
        raise ValueError(f"{path} is not a readable GGUF file: {reason}{where}") from None
    return GGUFFile(path, metadata, tensors)


class _TracingReader(gguf.GGUFReader):
    """``GGUFReader`` that remembers the last field it read, so a malformed file's error can say where."""

    last_field: list = [None]

    def _push_field(self, field, skip_sum: bool = False) -> int:
        type(self).last_field[0] = field.name
        return super()._push_field(field, skip_sum)


_MISSING = object()


def _meta(f: GGUFFile, key: str, kind: type, default=_MISSING, *, minimum=None):
    """Metadata value ``key`` (``.x`` means ``{arch}.x``) checked to be ``kind`` (int, float, str, bool, list),
    within ``[minimum, 2**31)`` for numbers. Raises ValueError naming the file and the key."""
    full = f.metadata.get("general.architecture", "") + key if key.startswith(".") else key
    value = f.metadata.get(full, default)
    if value is _MISSING:
        raise ValueError(f"{f.path}: GGUF metadata {full} is missing")
    if value is default:
        return value
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if ok and kind in (int, float):
        ok = (minimum is None or value >= minimum) and abs(value) < 2**31
    if not ok:
        bound = f" >= {minimum}" if minimum is not None else ""
        article = "an" if kind.__name__[0] in "aeiou" else "a"
        raise ValueError(f"{f.path}: GGUF metadata {full}={value!r:.60} must be {article} {kind.__name__}{bound}")
    return value


def hf_config_from_gguf(f: GGUFFile) -> dict:
    """The ``config.json`` dict transformers would use for this file (architectures ``llama``, ``qwen2``).

    Raises ValueError naming the key for an unsupported architecture, RoPE scaling type or partial RoPE.
    """
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"{f.path}: GGUF general.architecture={arch!r} is not supported; supported: "
                         f"{sorted(ARCHITECTURES)}")
    heads = _meta(f, ".attention.head_count", int, minimum=1)
    hidden = _meta(f, ".embedding_length", int, minimum=1)
    head_dim = _meta(f, ".attention.key_length", int, None, minimum=1) or hidden // heads
    if _meta(f, ".rope.dimension_count", int, head_dim) != head_dim:
        raise ValueError(f"{f.path}: GGUF {arch}.rope.dimension_count={f.get('.rope.dimension_count')} != "
                         f"head_dim={head_dim} (partial RoPE) is not supported")
    rope = {"rope_type": "default"}
    scaling = _meta(f, ".rope.scaling.type", str, "none")
    if scaling == "linear":
        rope = {"rope_type": "linear", "factor": float(_meta(f, ".rope.scaling.factor", float, minimum=1))}
    elif scaling != "none":
        raise ValueError(f"{f.path}: GGUF {arch}.rope.scaling.type={scaling!r} is not supported; valid: "
                         "['none', 'linear']")
    rope["rope_theta"] = float(_meta(f, ".rope.freq_base", float, 10000.0, minimum=1e-6))
    if "rope_freqs.weight" in f.tensors:
        raise ValueError(f"{f.path}: GGUF tensor 'rope_freqs.weight' (per-frequency RoPE factors, Llama 3.1 "
                         "scaling) is not supported; use the HF checkpoint (rope_type llama3)")
    if "token_embd.weight" not in f.tensors or len(f.tensors["token_embd.weight"].shape) != 2:
        raise ValueError(f"{f.path}: GGUF tensor 'token_embd.weight' (2-D embedding) is missing")
    return dict(
        architectures=[ARCHITECTURES[arch]], vocab_size=int(f.tensors["token_embd.weight"].shape[-1]),
        hidden_size=hidden, intermediate_size=_meta(f, ".feed_forward_length", int, minimum=1),
        num_hidden_layers=_block_count(f), num_attention_heads=heads,
        num_key_value_heads=_meta(f, ".attention.head_count_kv", int, heads, minimum=1), head_dim=head_dim,
        rms_norm_eps=float(_meta(f, ".attention.layer_norm_rms_epsilon", float, 1e-5, minimum=0)),
        max_position_embeddings=_meta(f, ".context_length", int, 2048, minimum=1), rope_parameters=rope,
        tie_word_embeddings="output.weight" not in f.tensors,
        attention_bias="blk.0.attn_q.bias" in f.tensors or "blk.0.attn_output.bias" in f.tensors,
        mlp_bias="blk.0.ffn_gate.bias" in f.tensors, hidden_act="silu")


def _block_count(f: GGUFFile) -> int:
    """``{arch}.block_count``, at most the number of tensors (each block has several): a forged count must not
    make the importer build a name table of billions of layers."""
    n = _meta(f, ".block_count", int, minimum=1)
    if n > len(f.tensors):
        raise ValueError(f"{f.path}: GGUF metadata {f.architecture}.block_count={n} exceeds the file's "
                         f"{len(f.tensors)} tensors")
    return n


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (pairs interleaved per head) -> HF's rotate_half order. ``w: [heads*d, ...]``."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | os.PathLike | GGUFFile, *, dtype: str | None = None) -> tuple[ModelConfig, Transformer, str]:
    """Load a GGUF file (a path, or a ``GGUFFile`` from ``open_gguf``) into a ``Transformer`` (dequantized to
    float32, then cast to ``dtype``).

    Same contract as ``hf.load_hf``: returns ``(config, model, HF architecture name)``; ``dtype`` defaults
    to ``"float32"``. Raises FileNotFoundError, or ValueError naming the unsupported key or the tensor that
    is missing, mis-shaped or unused.
    """
    f = path if isinstance(path, GGUFFile) else open_gguf(path)
    with naming(f.path, "GGUF metadata"):
        cfg, arch = config_from_hf(hf_config_from_gguf(f))
    dtype = dtype or "float32"
    cfg = cfg.replace(param_dtype=dtype, dtype="float32" if dtype == "float32" else dtype)
    names = _gguf_to_hf_names(f.architecture, cfg.num_layers)
    gguf_to_hf = {}
    for name in f.tensors:
        hf_name = names.get(name)
        if hf_name is None:
            raise ValueError(f"GGUF tensor {name!r} in {f.path} has no counterpart in {arch}; "
                             "rag-jax refuses to drop it")
        gguf_to_hf[hf_name] = name

    def get_tensor(hf_name):
        t = f.tensors[gguf_to_hf[hf_name]]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except NotImplementedError as e:
            raise ValueError(f"{f.path}: GGUF tensor {t.name!r} has type {t.tensor_type.name}, which gguf.quants "
                             f"cannot dequantize: {one_line(e, 120)}") from None
        except (ValueError, TypeError, IndexError) as e:  # data not a whole number of blocks / rows
            raise ValueError(f"{f.path}: GGUF tensor {t.name!r} ({t.tensor_type.name}, shape {list(t.shape)}) has "
                             f"malformed data: {one_line(e, 120)}") from None
        if f.architecture == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = cfg.num_heads if ".q_proj." in hf_name else cfg.num_kv_heads
            try:
                w = _unpermute(w, heads)
            except ValueError:
                raise ValueError(f"{f.path}: GGUF tensor {t.name!r} has shape {list(w.shape)}, which does not hold "
                                 f"{heads} heads of even size (expected [{heads} * head_dim, hidden])") from None
        return w

    model = build_model(cfg, gguf_to_hf, get_tensor, f"GGUF file {f.path}")
    return cfg, model, arch


_HF_PARTS = ("model.embed_tokens", "model.norm", "lm_head", "self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
             "input_layernorm", "post_attention_layernorm")


def _gguf_to_hf_names(architecture: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> HF name, inverted from ``gguf``'s own HF -> GGUF table."""
    arch_enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[architecture]
    name_map = gguf.get_tensor_name_map(arch_enum, num_layers)
    table = {}
    for part in _HF_PARTS:
        per_layer = not part.startswith(("model.", "lm_head"))
        for base in [f"model.layers.{i}.{part}" for i in range(num_layers)] if per_layer else [part]:
            mapped = name_map.get_name(base)
            if mapped is not None:
                table[mapped + ".weight"], table[mapped + ".bias"] = base + ".weight", base + ".bias"
    return table


# ---------------------------------------------------------------------------------------------- tokenizer


def tokenizer_from_gguf(f: GGUFFile) -> Tokenizer:
    """Byte-level BPE ``Tokenizer`` from ``tokenizer.ggml.*`` (``tokenizer.ggml.model == "gpt2"``).

    Pre-tokenizer: the regex list named by ``tokenizer.ggml.pre`` (``PRE_TOKENIZERS``), then byte-level
    mapping. Control tokens (``token_type == 3``) are special; user-defined ones (4) are matched whole.
    ``tokenizer.ggml.add_bos_token`` prepends the bos token. Raises ValueError naming the key for any other
    tokenizer model or an unknown pre-tokenizer.
    """
    model = f.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{f.path}: GGUF tokenizer.ggml.model={model!r:.60} is not supported; valid: ['gpt2'] "
                         "(byte-level BPE)")
    pre = f.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
        raise ValueError(f"{f.path}: GGUF tokenizer.ggml.pre={pre!r:.60} is not supported; valid: "
                         f"{sorted(PRE_TOKENIZERS)}")
    tokens = _meta(f, "tokenizer.ggml.tokens", list)
    merges = _meta(f, "tokenizer.ggml.merges", list, [])
    for key, values in (("tokens", tokens), ("merges", merges)):
        bad = next((i for i, v in enumerate(values) if not isinstance(v, str) or (key == "merges" and " " not in v)),
                   None)
        if bad is not None:
            raise ValueError(f"{f.path}: GGUF tokenizer.ggml.{key}[{bad}]={values[bad]!r:.40} must be a "
                             + ("'left right' pair" if key == "merges" else "str"))
    merges = [tuple(m.split(" ", 1)) for m in merges]
    try:
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                                   ignore_merges=False))
    except Exception as e:  # tokenizers (Rust) raises a bare Exception, e.g. a merge of unknown tokens
        raise ValueError(f"{f.path}: GGUF tokenizer.ggml.tokens/merges do not form a BPE vocabulary "
                         f"({one_line(e, 160)})") from None
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                    use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = _meta(f, "tokenizer.ggml.token_type", list, [])
    byte_alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
                            if k == _CONTROL and set(t) <= byte_alphabet])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
                    if k == _USER_DEFINED])
    bos = special_tokens(f).get("bos")
    if _meta(f, "tokenizer.ggml.add_bos_token", bool, False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
                                                           special_tokens=[(tokens[bos], bos)])
    return tok


def special_tokens(f: GGUFFile) -> dict[str, int]:
    """``{"bos": id, "eos": id, "pad": id, "unk": id, "eot": id}`` for the ids the file states."""
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id", "unk": "unknown_token_id",
            "eot": "eot_token_id"}
    size = len(_meta(f, "tokenizer.ggml.tokens", list, []))
    out = {}
    for k, v in keys.items():
        value = _meta(f, f"tokenizer.ggml.{v}", int, None, minimum=0)
        if value is not None:
            if size and value >= size:
                raise ValueError(f"{f.path}: GGUF metadata tokenizer.ggml.{v}={value} is not a token id (the "
                                 f"vocabulary has {size} tokens)")
            out[k] = value
    return out


def special_token_strings(f: GGUFFile) -> dict[str, str]:
    """``{"bos_token": "<|im_start|>", "eos_token": ..., "pad_token": ..., "unk_token": ...}`` (those stated)."""
    tokens = f.get("tokenizer.ggml.tokens") or []
    return {f"{k}_token": tokens[i] for k, i in special_tokens(f).items()
            if k in ("bos", "eos", "pad", "unk") and i < len(tokens)}


def eos_ids(f: GGUFFile) -> tuple[int, ...]:
    """Ids that end a reply: ``tokenizer.ggml.eos_token_id`` and ``eot_token_id`` (those stated)."""
    ids = special_tokens(f)
    return tuple(dict.fromkeys(ids[k] for k in ("eos", "eot") if k in ids))


def chat_template(f: GGUFFile) -> str | None:
    """The Jinja chat template stored in ``tokenizer.chat_template``, or None."""
    return _meta(f, "tokenizer.chat_template", str, None)


def convert_gguf(path: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "float32") -> Path:
    """Write GGUF ``path`` as an HF safetensors folder ``out`` (atomically), dequantized to ``dtype``.

    Besides ``config.json`` and ``model.safetensors`` the folder gets ``tokenizer.json``,
    ``tokenizer_config.json`` (chat template, special tokens) and ``generation_config.json`` (bos/eos ids)
    when the file holds a tokenizer, so ``transformers.AutoTokenizer``/``AutoModelForCausalLM`` load it.
    """
    f = open_gguf(path)
    _, model, arch = load_gguf(f, dtype=dtype)
    extra = {}
    if f.get("tokenizer.ggml.tokens") is not None:
        ids = special_tokens(f)
        extra["tokenizer.json"] = tokenizer_from_gguf(f).to_str()
        tok_cfg = special_token_strings(f)
        tok_cfg.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=model.config.max_seq_len,
                       add_bos_token=bool(f.get("tokenizer.ggml.add_bos_token")))
        if chat_template(f):
            tok_cfg["chat_template"] = chat_template(f)
        extra["tokenizer_config.json"] = json.dumps(tok_cfg, indent=2, ensure_ascii=False)
        gen = {k + "_token_id": ids[k] for k in ("bos", "pad") if k in ids}
        eos = eos_ids(f)
        if eos:
            gen["eos_token_id"] = eos[0] if len(eos) == 1 else list(eos)
        extra["generation_config.json"] = json.dumps(gen, indent=2)
    return save_hf(model, out, arch, extra_files=extra)
