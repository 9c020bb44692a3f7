"""The one way evaluation scripts resolve ``--model PATH`` into a model (``rag_jax.model.load.load_model``):
a run folder, an HF folder, a ``.gguf`` file or an embedded model name.

- run folder (``rag-jax train`` / ``rag-jax demo`` output; ``rag_jax.model.run_folder``): the latest orbax
  step, its ``config.yaml`` and ``tokenizer.json``;
- HF folder (``config.json`` + ``*.safetensors``, e.g. ``rag_jax.model.hf.save_hf`` output or a Llama / Qwen
  checkpoint): ``rag_jax.model.hf.load_hf``, with ``tokenizer.json`` when present.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from rag_jax import config as config_lib
from rag_jax.data.phantom_rag import GRIT_INSTRUCTION, TaskConfig, UniverseConfig
from rag_jax.evaluation.rag import RetrievalConfig
from rag_jax.model.load import LoadedModel, load_model


def load_for_eval(path: str | os.PathLike) -> LoadedModel:
    """Load ``--model`` (``rag_jax.model.load.load_model``: a run folder, an HF folder, a ``.gguf`` file or an
    embedded model name such as ``smollm2-135m-instruct``) on one device, in float32 for HF / GGUF.

    Returns the ``LoadedModel`` (``.model`` the ``Transformer``, ``.config`` its ``ModelConfig``,
    ``.run_config`` a run folder's ``config.yaml``, ``.tokenizer`` None without ``tokenizer.json``).

    Raises:
      FileNotFoundError: ``path`` is none of those, or lacks a file its kind needs.
      ValueError: a malformed ``config.yaml`` / ``config.json``, or a checkpoint the importers refuse.
    """
    try:
        return load_model(path, dtype="float32")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--model: {e}") from None


@dataclasses.dataclass(frozen=True)
class GritSection:
    """The ``grit`` section a ``rag-jax demo`` run writes into its ``config.yaml`` for the evaluations that embed
    with the trained model.

    Attributes:
      instruction: the query instruction in GRIT embedding mode (documents get none).
      passage_max_len: passage token limit of the embedding mode (tokens, format prefix included).
    """

    instruction: str = GRIT_INSTRUCTION
    passage_max_len: int = 256

    def __post_init__(self):
        if self.passage_max_len < 1:
            raise ValueError(f"grit.passage_max_len={self.passage_max_len} must be >= 1")


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
    sections = {name: config_lib.from_dict(cls, config.get(name) or {}, prefix=f"{name}.")
                for name, cls in (("universe", UniverseConfig), ("task", TaskConfig), ("retrieval", RetrievalConfig))}
    grit = config_lib.from_dict(GritSection, config.get("grit") or {}, prefix="grit.")
    return RagSettings(**sections, grit_instruction=grit.instruction, passage_max_len=grit.passage_max_len)


def load_rag_model(path: str | os.PathLike) -> tuple[LoadedModel, RagSettings]:
    """:func:`load_for_eval` and :func:`rag_settings` for the PhantomWiki RAG evaluations (``rag_qa``,
    ``retrieval_recall``), which need the tokenizer.

    Raises:
      FileNotFoundError / ValueError: as :func:`load_for_eval` and :func:`rag_settings`; a model without
        ``tokenizer.json``.
    """
    loaded = load_for_eval(path)
    if loaded.tokenizer is None:
        raise FileNotFoundError(f"--model {path} has no tokenizer.json (the RAG prompts are text)")
    return loaded, rag_settings(loaded.run_config)
