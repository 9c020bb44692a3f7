"""``rag-jax demo`` configuration: typed sections, the demo's defaults, and the base-model lookup.

Loaded by the one config loader (``rag_jax.config.load_config``): defaults <- YAML (``--config``) <- ``key=value``.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from rag_jax import config as config_lib
from rag_jax.data.phantom_rag import GRIT_INSTRUCTION, TaskConfig, UniverseConfig
from rag_jax.evaluation.rag import PASSAGE_ORDERS, RetrievalConfig
from rag_jax.model.config import ModelConfig
from rag_jax.sharding import MeshConfig
from rag_jax.train.optim import OptimizerConfig
from rag_jax.train.trainer import TrainConfig, refuse_set_fields

DEFAULT_BASE = "demo_reader"
ASSETS = Path(__file__).resolve().parents[2] / "assets"

# Defaults of the sections whose dataclass defaults are not the demo's (a YAML/override that sets one
# field of these sections keeps the other demo defaults; ``model.preset`` replaces the model defaults).
DEMO_MODEL = dict(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_seq_len=1024)
DEMO_OPTIMIZER = dict(learning_rate=3e-3, warmup_steps=20, weight_decay=0.0, min_lr_ratio=0.1)
DEMO_TRAIN = dict(steps=200, log_every=1)
# Trainer fields the demo sets itself (a user value would be ignored, so it is refused).
DEMO_SETS = {"global_batch_size": "the demo's rows per step are joint.rag_batch_size and joint.embedding_batch_size",
             "grad_accum_steps": "the demo trains without gradient accumulation",
             "objective": "the demo's objective is GRIT + Block-Attention (joint section)",
             "eval_every": "the demo evaluates after training (eval section)",
             "run_dir": "the run folder is --out"}


# ---------------------------------------------------------------------------------------------
# Configuration.


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """Attributes: vocab_size: BPE vocabulary (>= 260); the model's ``vocab_size`` is set from it."""

    vocab_size: int = 1024


@dataclasses.dataclass(frozen=True)
class JointConfig:
    """The demo's job section: joint GRIT + Block-Attention training (the trainer's own fields, such as ``steps``,
    ``seed``, ``precision``, ``remat_policy`` and ``log_every``, are the ``train`` section, ``trainer.TrainConfig``).

    Attributes:
      rag_batch_size: RAG prompts per step (Block-Attention loss, both modes).
      embedding_batch_size: GRIT queries per step (in-batch negatives + hard negatives).
      group_size: GRIT passages per query (1 positive + group_size - 1 hard negatives).
      seq_len: padded RAG row length in tokens; 0 = from the data (k passages of 90th-percentile length).
      query_max_len / passage_max_len: GRIT token limits incl. the format prefix; 0 = from the data
        (the longest training query; the 90th-percentile passage).
      lm_weight: next-token loss weight of passage tokens (answer tokens weigh 1, question tokens 0).
      max_turns: questions per RAG row (1 = only the inference layout; see ``_TrainingData``).
      full_weight / block_weight: Block-Attention loss weights of the full and block passes.
      gen_weight: λ_Gen of GRIT Eq. 3 (weight of the Block-Attention loss against L_Rep).
      grit_temperature: InfoNCE temperature (GritLM: 0.02; 0.05 trains more stably from scratch).
      grit_instruction: query instruction in GRIT embedding mode (documents get none).
      devices: devices of the training mesh; 0 = 1 on CPU (fake CPU devices do not add compute),
        all devices on GPU/TPU.
    """

    rag_batch_size: int = 8
    embedding_batch_size: int = 8
    group_size: int = 2
    seq_len: int = 0
    query_max_len: int = 0
    passage_max_len: int = 0
    lm_weight: float = 0.2
    max_turns: int = 6
    full_weight: float = 1.0
    block_weight: float = 1.0
    gen_weight: float = 1.0
    grit_temperature: float = 0.05
    grit_instruction: str = GRIT_INSTRUCTION
    devices: int = 0

    def __post_init__(self):
        for name in ("rag_batch_size", "embedding_batch_size", "group_size", "max_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"joint.{name}={getattr(self, name)} must be >= 1")
        for name in ("seq_len", "query_max_len", "passage_max_len", "devices"):
            if getattr(self, name) < 0:
                raise ValueError(f"joint.{name}={getattr(self, name)} must be >= 0 (0 = automatic)")
        for name in ("lm_weight", "full_weight", "block_weight", "gen_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"joint.{name}={getattr(self, name)} must be >= 0")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Attributes:
      max_questions: held-out questions answered (the first ones of the held-out set).
      max_new_tokens: cap on generated answer tokens (the longest training answer + 2 is used below it).
      batch_size: prompts per generation call.
      ttft_passages: passages per prompt for the TTFT curve (sizes that exceed max_seq_len are skipped).
      ttft_repeats: timed runs per point (median reported, after one warm-up run).
      passage_order: prompt order of the retrieved (and gold-first oracle) passages: ``rank`` (best first) or
        ``reverse`` (best last, next to the question; the real-model track's default), see
        ``rag_jax.evaluation.rag.prompt_order``.
    """

    max_questions: int = 100
    max_new_tokens: int = 32
    batch_size: int = 128
    ttft_passages: tuple[int, ...] = (1, 2, 4, 6)
    ttft_repeats: int = 5
    passage_order: str = "rank"

    def __post_init__(self):
        for name in ("max_questions", "max_new_tokens", "batch_size", "ttft_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval.{name}={getattr(self, name)} must be >= 1")
        if any(n < 1 for n in self.ttft_passages):
            raise ValueError(f"eval.ttft_passages={self.ttft_passages!r} must be ints >= 1 (may be empty)")
        if self.passage_order not in PASSAGE_ORDERS:
            raise ValueError(f"eval.passage_order={self.passage_order!r}; valid: {', '.join(PASSAGE_ORDERS)}")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """The whole demo (sections above; ``model`` is a ``ModelConfig`` whose ``vocab_size`` is replaced
    by the trained tokenizer's, ``optimizer`` an ``OptimizerConfig``, ``mesh`` a ``MeshConfig``).

    ``base``: the model to fine-tune (module docstring, stage 2): the name of a packaged base
    (``demo_reader``, in ``rag_jax/assets/``), or a path to an HF-format folder (``config.json``,
    ``*.safetensors``, ``tokenizer.json``); ``None`` (``base: null``) trains the tokenizer and a random
    ``model`` from scratch. With a base, the ``model`` and ``tokenizer`` sections must not be set (the base
    fixes both)."""

    base: str | None = DEFAULT_BASE

    universe: UniverseConfig = dataclasses.field(default_factory=UniverseConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(**DEMO_MODEL))
    optimizer: OptimizerConfig = dataclasses.field(default_factory=lambda: OptimizerConfig(**DEMO_OPTIMIZER))
    train: TrainConfig = dataclasses.field(default_factory=lambda: TrainConfig(**DEMO_TRAIN))
    joint: JointConfig = dataclasses.field(default_factory=JointConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    retrieval: RetrievalConfig = dataclasses.field(default_factory=RetrievalConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)


    def __post_init__(self):
        refuse_set_fields(self.train, DEMO_SETS)
        fixed = [name for name, default in (("model", ModelConfig(**DEMO_MODEL)), ("tokenizer", TokenizerConfig()))
                 if getattr(self, name) != default]
        if self.base is not None and fixed:
            raise config_lib.ConfigError(
                f"{' and '.join(fixed)} section(s) set while base={self.base!r}: the base model fixes the "
                "architecture and tokenizer; remove them, or set base=null to train a tokenizer and model from scratch")


# Defaults of the real-model track (``rag-jax demo --model``): a 135M model generating on CPU answers fewer
# questions, and its sentence replies need more tokens than the tiny reader's spans.
# It reads best the passage next to the question (``prompt_order``), so retrieved passages go best last.
REAL_MODEL_EVAL = dict(max_questions=50, max_new_tokens=24, batch_size=64, ttft_passages=[1, 2, 4], ttft_repeats=3,
                       passage_order="reverse")


def _demo_defaults(user: dict, real_model: bool = False) -> dict:
    model = user.get("model")
    preset = isinstance(model, dict) and "preset" in model
    return {"optimizer": dict(DEMO_OPTIMIZER), **({} if preset else {"model": dict(DEMO_MODEL)}),
            **({"eval": dict(REAL_MODEL_EVAL)} if real_model else {})}


def load_demo_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = (), *,
                     real_model: bool = False) -> DemoConfig:
    """Demo defaults <- YAML file <- ``key=value`` overrides (``rag_jax.config.load_config``).

    ``real_model``: the real-model track's ``eval`` defaults (``REAL_MODEL_EVAL``) replace the CPU demo's.

    Raises:
      rag_jax.config.ConfigError (a ValueError): missing/invalid YAML, unknown key (with the closest
        valid one), wrong type, key set twice, a section's own validation error, or ``model`` /
        ``tokenizer`` set while a ``base`` fixes them.
    """
    return config_lib.load_config(DemoConfig, path, list(overrides),
                                  defaults=lambda user: _demo_defaults(user, real_model))


def resolve_base(base: str) -> Path:
    """The folder of ``DemoConfig.base``: a packaged base name (``rag_jax/assets/<name>``) or a path.

    Raises:
      FileNotFoundError: no such folder, or it lacks ``config.json``, a ``*.safetensors`` file or
        ``tokenizer.json``.
    """
    path = ASSETS / base if (ASSETS / base).is_dir() and "/" not in base else Path(base)
    packaged = sorted(p.name for p in ASSETS.iterdir() if p.is_dir()) if ASSETS.is_dir() else []
    if not path.is_dir():
        raise FileNotFoundError(f"base={base!r}: no such folder; use a packaged base {packaged}, an HF-format "
                                "folder with tokenizer.json, or base=null (train from scratch)")
    missing = [n for n in ("config.json", "tokenizer.json") if not (path / n).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise FileNotFoundError(f"base={base!r} ({path}) lacks {missing}; an HF-format folder with "
                                "tokenizer.json is needed")
    return path


