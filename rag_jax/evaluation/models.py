"""The one way evaluation scripts resolve ``--model PATH`` into a model: a run folder or an HF folder.

- run folder (``rag-jax train`` / ``rag-jax demo`` output; ``rag_jax.train.run_folder``): the latest orbax
  step, its ``config.yaml`` and ``tokenizer.json``;
- HF folder (``config.json`` + ``*.safetensors``, e.g. ``rag_jax.model.hf.save_hf`` output or a Llama / Qwen
  checkpoint): ``rag_jax.model.hf.load_hf``, with ``tokenizer.json`` when present.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class EvalModel:
    """A model to evaluate.

    Attributes:
      path: where it was loaded from.
      kind: ``"run"`` (run folder) or ``"hf"`` (HF folder).
      config: the run's resolved ``config.yaml`` as a dict (``{}`` for an HF folder); its ``model`` entry is
        the ``ModelConfig``.
      model_config: the ``ModelConfig``.
      graphdef, params: the model split for ``BlockAttention`` / ``GritEmbedder`` / ``EMLLM``
        (``(graphdef, params)``; :meth:`module` merges them).
      tokenizer: a ``tokenizers.Tokenizer``; None for an HF folder without ``tokenizer.json``.
    """

    path: Path
    kind: str
    config: dict[str, Any]
    model_config: Any
    graphdef: Any
    params: Any
    tokenizer: Any

    @property
    def model(self) -> tuple[Any, Any]:
        return self.graphdef, self.params

    def module(self):
        """The ``nnx`` module (``nnx.merge(graphdef, params)``)."""
        from flax import nnx
        return nnx.merge(self.graphdef, self.params)


def load_for_eval(path: str | os.PathLike) -> EvalModel:
    """Load ``path`` (a run folder or an HF folder, module docstring) on one device.

    Raises:
      FileNotFoundError: ``path`` does not exist, or is neither a run folder (``config.yaml`` +
        ``checkpoints/``) nor an HF folder (``config.json``), or lacks a file its kind needs.
      ValueError: a malformed ``config.yaml`` / ``config.json``.
    """
    from rag_jax.train.run_folder import is_run_folder, load_run

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--model {path} does not exist; pass a run folder (rag-jax train / rag-jax demo "
                                "output) or an HF folder (config.json + *.safetensors)")
    if is_run_folder(path):
        config, graphdef, params, tokenizer = load_run(path)
        return EvalModel(path, "run", config, config["model"], graphdef, params, tokenizer)
    if (path / "config.json").is_file():
        from flax import nnx

        from rag_jax.data.tokenizer import load_tokenizer
        from rag_jax.model.hf import load_hf
        model_cfg, model, _ = load_hf(path, dtype="float32")
        graphdef, params = nnx.split(model)
        tokenizer = load_tokenizer(path) if (path / "tokenizer.json").is_file() else None
        return EvalModel(path, "hf", {}, model_cfg, graphdef, params, tokenizer)
    raise FileNotFoundError(f"--model {path} is neither a run folder (config.yaml + checkpoints/) nor an HF folder "
                            "(config.json + *.safetensors)")


@dataclasses.dataclass(frozen=True)
class RagSettings:
    """What a ``rag-jax demo`` run was trained and evaluated with (``config.yaml`` sections ``universe``,
    ``task``, ``retrieval`` and ``grit``); the demo's defaults for any other model."""

    universe: Any
    task: Any
    retrieval: Any
    grit_instruction: str
    passage_max_len: int


def rag_settings(config: dict[str, Any]) -> RagSettings:
    """:class:`RagSettings` from a run folder's ``config`` dict (missing sections: the demo's defaults).

    Raises:
      ValueError: a section with an unknown key or a bad value (the key named).
    """
    from rag_jax import config as config_lib
    from rag_jax.data.phantom_rag import TaskConfig, UniverseConfig
    from rag_jax.demo.config import DemoTrainConfig, RetrievalConfig

    sections = {name: config_lib.from_dict(cls, config.get(name) or {}, prefix=f"{name}.")
                for name, cls in (("universe", UniverseConfig), ("task", TaskConfig), ("retrieval", RetrievalConfig))}
    grit = config.get("grit") or {}
    return RagSettings(**sections, grit_instruction=grit.get("instruction", DemoTrainConfig.grit_instruction),
                       passage_max_len=int(grit.get("passage_max_len") or 256))


def load_rag_model(path: str | os.PathLike) -> tuple[EvalModel, RagSettings]:
    """:func:`load_for_eval` and :func:`rag_settings` for the PhantomWiki RAG evaluations (``rag_qa``,
    ``retrieval_recall``), which need the tokenizer.

    Raises:
      FileNotFoundError / ValueError: as :func:`load_for_eval` and :func:`rag_settings`; a model without
        ``tokenizer.json``.
    """
    loaded = load_for_eval(path)
    if loaded.tokenizer is None:
        raise FileNotFoundError(f"--model {path} has no tokenizer.json (the RAG prompts are text)")
    return loaded, rag_settings(loaded.config)
