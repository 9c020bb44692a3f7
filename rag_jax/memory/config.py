"""Configuration of EM-LLM episodic memory (Fountas et al., ICLR 2025), validated before any compute.

Field names follow the reference code's yaml (``n_init``, ``n_local``, ``n_mem``, ``min_block_size``,
``max_block_size``, ``repr_topk``, ...; research note ``em_llm.md`` §5). ``chunk_size`` is the reference's
``exc_block_size`` (= its prefill ``chunk_size``): the number of tokens processed per forward step.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rag_jax import config as config_lib


SEGMENTATIONS = ("surprise", "uniform")
REFINEMENTS = (None, "modularity", "conductance")
POSITION_MODES = ("inf_llm", "contiguous")
INDEX_KINDS = ("scann", "scann_auto", "exact")


@dataclasses.dataclass(frozen=True)
class EMLLMConfig:
    """EM-LLM memory settings (all sizes in tokens).

    Attributes:
      n_init: initial tokens kept forever (attention sinks).
      n_local: local sliding window: a query attends to the previous ``n_local`` tokens with their true
        relative positions.
      n_mem: token budget of retrieved events (approximate, as in the reference: §4.3 of the note).
      chunk_size: tokens per forward step in prefill (reference ``exc_block_size``); must be <= ``n_local``.
      min_block_size, max_block_size: event size bounds (reference 8 / 128).
      repr_topk: representative tokens per event and query head (reference 4).
      surprise_gamma: γ in the threshold ``mean + γ·std`` of surprise (reference configs 1.0).
      segmentation: ``"surprise"`` (EM-LLM) or ``"uniform"`` (InfLLM-style fixed ``max_block_size`` blocks).
      refinement: ``None``, ``"modularity"`` (maximised) or ``"conductance"`` (minimised) boundary refinement.
      refine_from_layer: first layer whose keys form the similarity graph (reference 20 of 32 layers).
      refine_with_buffer: include the tokens since the previous chunk's last boundary in the graph.
      contiguity: add temporal neighbours of retrieved events (contiguity buffer).
      contiguity_ratio: share of the retrieval budget for the contiguity buffer (< 1: a fraction, as the
        reference's 0.3; >= 1: a number of tokens).
      positions: ``"inf_llm"`` (memory keys unrotated, query at distance ``n_local - 1``) or
        ``"contiguous"`` (memory re-encoded at contiguous positions before the local window).
      index: event lookup through ``rag_jax.retrieval``: ``"scann"`` (``ScannIndex`` scoring every event
        exactly, as the reference's ``sort_by_similarity``, at every store size), ``"scann_auto"`` (ScaNN's
        size-based parameters: quantized AH search above 20K events; faster past millions of events but
        approximate: on the passkey eval at 1M tokens (~30K events) it lost the key's event, 0/2 prompts, where
        exact scoring answered 2/2), or ``"exact"`` (``ExactIndex``, JAX on the host CPU).
      max_cached_events: device cache slots per layer (each ``max_block_size`` tokens); ``None`` sizes it
        to hold the largest retrieval.
      memory: ``False`` turns memory off (no init tokens, events or retrieval): the sliding-window baseline.
    """

    n_init: int = 16
    n_local: int = 256
    n_mem: int = 256
    chunk_size: int = 64
    min_block_size: int = 8
    max_block_size: int = 32
    repr_topk: int = 4
    surprise_gamma: float = 1.0
    segmentation: str = "surprise"
    refinement: str | None = None
    refine_from_layer: int = 0
    refine_with_buffer: bool = True
    contiguity: bool = False
    contiguity_ratio: float = 0.3
    positions: str = "inf_llm"
    index: str = "scann"
    max_cached_events: int | None = None
    memory: bool = True

    def __post_init__(self):
        for name in ("n_local", "n_mem", "chunk_size", "min_block_size", "max_block_size", "repr_topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EMLLMConfig.{name}={value!r} must be a positive integer (tokens)")
        for name in ("n_init", "refine_from_layer"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"EMLLMConfig.{name}={value!r} must be an integer >= 0")
        if not isinstance(self.surprise_gamma, (int, float)) or not math.isfinite(self.surprise_gamma) \
                or self.surprise_gamma < 0:
            raise ValueError(f"EMLLMConfig.surprise_gamma={self.surprise_gamma!r} must be a finite number >= 0 "
                             "(the threshold is mean + gamma * std of surprise)")
        if self.min_block_size > self.max_block_size:
            raise ValueError(f"min_block_size={self.min_block_size} must be <= max_block_size={self.max_block_size}")
        if self.chunk_size > self.n_local:
            raise ValueError(f"chunk_size={self.chunk_size} must be <= n_local={self.n_local} "
                             "(the reference asserts exc_block_size <= n_local)")
        if self.n_mem < self.max_block_size:
            raise ValueError(f"n_mem={self.n_mem} tokens is smaller than one event (max_block_size="
                             f"{self.max_block_size}); use n_mem >= {self.max_block_size}")
        if self.segmentation not in SEGMENTATIONS:
            raise ValueError(f"segmentation={self.segmentation!r}; valid: {SEGMENTATIONS}")
        if self.refinement not in REFINEMENTS:
            raise ValueError(f"refinement={self.refinement!r}; valid: {REFINEMENTS}")
        if self.positions not in POSITION_MODES:
            raise ValueError(f"positions={self.positions!r}; valid: {POSITION_MODES}")
        if self.index not in INDEX_KINDS:
            raise ValueError(f"index={self.index!r}; valid: {INDEX_KINDS}")
        ratio = self.contiguity_ratio
        if not (0 < ratio < 1 or (ratio >= 1 and float(ratio).is_integer())):
            raise ValueError(f"contiguity_ratio={self.contiguity_ratio!r} must be a fraction in (0, 1) or a whole "
                             "number of tokens >= 1")
        if self.max_cached_events is not None and self.max_cached_events < self.required_cached_events:
            raise ValueError(f"max_cached_events={self.max_cached_events} cannot hold one retrieval of up to "
                             f"{self.memory_capacity} tokens in events of >= {self.min_block_size} tokens; use "
                             f">= {self.required_cached_events} or None")

    @property
    def retrieval_cap(self) -> int:
        """Largest retrieval budget in tokens: the reference's ``global_context_cap = n_init + chunk + n_mem``."""
        return self.n_init + self.chunk_size + self.n_mem

    @property
    def memory_capacity(self) -> int:
        """Device slots for retrieved event tokens: the budget plus two closest-fit overshoots (reference
        ``buffer_len = global_context_cap + 2 * max_block_size``)."""
        return self.retrieval_cap + 2 * self.max_block_size

    @property
    def required_cached_events(self) -> int:
        """Events one retrieval can load at most (every event holds >= ``min_block_size`` tokens)."""
        return -(-self.memory_capacity // self.min_block_size) + 1

    @property
    def cached_events(self) -> int:
        return self.max_cached_events if self.max_cached_events is not None else self.required_cached_events

    def replace(self, **changes) -> "EMLLMConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "EMLLMConfig":
        """Build from a mapping (``rag_jax.config.from_dict``: typed; an unknown key raises ValueError naming
        it and the closest valid one)."""
        return config_lib.from_dict(cls, values, prefix="em_llm.")

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Sequence[str] = ()) -> "EMLLMConfig":
        """Load ``path`` (a mapping, optionally under an ``em_llm:`` key) with ``key=value`` ``overrides``
        (``rag_jax.config``: the one loader; duplicate keys, unknown keys and wrong types are errors)."""
        return config_lib.load_config(cls, path, list(overrides), section="em_llm")
