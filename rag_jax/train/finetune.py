"""Supervised fine-tuning of a pretrained chat model on prompts with responses, with the one trainer
(``trainer.run``): loss on the response tokens only.

``modes="full+block"`` is Block-Attention fine-tuning (Ma, Wang, Lan, ICLR 2025, §2.4; research note
``shared/research/block_attention.md`` §1.4): the v5 recipe trains every sample once in full and once in block
attention. A step is then the mixed batch of ``batch_size`` examples (``block_rag.mixed_batch``: ``2 *
batch_size`` rows, one model call, ``objectives.block.MixedBlockLoss``). ``modes="full"`` trains full attention
only (``batch_size`` rows, every token global): plain SFT, e.g. on the synthetic retrieval prompts of Artificial
Needles (``rag_jax.data.needles``, Xiong et al., ICLR 2025, §3: loss on the answer only). For a CPU budget only the top ``train_layers`` decoder
layers and the final norm are trained (``optimizer.trainable``; the embedding, tied to the output head, and
the lower layers stay frozen bit-exactly and no backward pass runs through them); ``train_layers=0`` trains
every parameter (the paper's full fine-tuning, for an accelerator).

The result is a run folder (``config.yaml`` with the base model's ``chat`` section, ``tokenizer.json``,
``checkpoints/``) that ``load_model`` / ``--model`` accepts; a rerun with the same folder resumes.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import numpy as np

from rag_jax.data.block_rag import BlockExample, collate, mixed_batch
from rag_jax.data.pipeline import DataConfig
from rag_jax.model.load import chat_section
from rag_jax.model.lora import LORA_TRAINABLE, add_lora
from rag_jax.train import checkpoint, optim, trainer
from rag_jax.train.objectives.block import MixedBlockLoss


MODES = ("full+block", "full")


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """Attributes:
      steps: optimizer steps.
      batch_size: examples per step (with ``modes="full+block"`` the batch has twice as many rows).
      modes: ``"full+block"`` (Block-Attention's 1:1 mix) or ``"full"`` (full attention only).
      seq_len: row length in tokens (every example must fit; one compiled shape).
      train_layers: top decoder layers trained, with the final norm; 0 = every parameter.
      lora_rank: 0 trains those parameters; ``r`` trains rank-``r`` LoRA adapters (``model.lora``) on every
        projection of those layers instead (weights, norms and embedding frozen); the run folder's model carries
        the adapters (``load_model`` applies them; ``model.delta`` / HF export fold them in).
      learning_rate, warmup_steps: AdamW peak rate (cosine decay to 10%) and linear warmup; no weight decay.
      seed: example order.
      save_every: checkpoint interval in steps (the last step is always saved).
      log_every: steps between ``metrics.jsonl`` rows.
    """

    steps: int = 100
    batch_size: int = 4
    seq_len: int = 768
    train_layers: int = 4
    learning_rate: float = 1e-4
    warmup_steps: int = 10
    seed: int = 0
    save_every: int = 50
    log_every: int = 1
    modes: str = "full+block"
    lora_rank: int = 0

    def __post_init__(self):
        if self.modes not in MODES:
            raise ValueError(f"finetune modes={self.modes!r}; valid: {', '.join(MODES)}")
        for name in ("steps", "batch_size", "seq_len", "save_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"finetune {name}={getattr(self, name)} must be >= 1")
        if self.train_layers < 0:
            raise ValueError(f"finetune train_layers={self.train_layers} must be >= 0 (0 = all parameters)")
        if self.lora_rank < 0:
            raise ValueError(f"finetune lora_rank={self.lora_rank} must be >= 0 (0 = train the weights)")


def top_layers(num_layers: int, n: int) -> str | None:
    """``optimizer.trainable`` regex of the top ``n`` of ``num_layers`` decoder layers and the final norm; None
    (all parameters) for ``n == 0``. Raises ValueError unless ``0 <= n <= num_layers``."""
    if not 0 <= n <= num_layers:
        raise ValueError(f"train_layers={n} must be in [0, num_layers={num_layers}]")
    if n == 0:
        return None
    return f"^(layers/({'|'.join(str(i) for i in range(num_layers - n, num_layers))})/|final_norm/)"


def top_adapters(num_layers: int, n: int) -> str:
    """``optimizer.trainable`` regex of the LoRA adapters of the top ``n`` of ``num_layers`` layers (all layers'
    for ``n == 0``). Raises ValueError unless ``0 <= n <= num_layers``."""
    layers = top_layers(num_layers, n)
    if layers is None:
        return LORA_TRAINABLE
    return f"^layers/({'|'.join(str(i) for i in range(num_layers - n, num_layers))})/.*{LORA_TRAINABLE}"


def finetune(loaded, examples: Sequence[BlockExample], cfg: FinetuneConfig, run_dir: str | os.PathLike, *,
             extra_config: dict | None = None, hooks: Sequence[Callable] = ()):
    """Fine-tune ``loaded`` (``rag_jax.model.load.LoadedModel``) on ``examples`` into the run folder ``run_dir``.

    Args:
      loaded: the base model with its tokenizer (and chat template, stored in the run folder).
      examples: training examples with responses (the loss targets), each at most ``cfg.seq_len`` tokens.
      cfg: the recipe.
      run_dir: the run folder (resumed when it holds checkpoints of the same run).
      extra_config: more ``config.yaml`` sections (e.g. the data settings; part of the resume fingerprint).
      hooks: ``trainer.run`` hooks.

    Returns:
      the ``trainer.TrainResult``.

    Raises:
      ValueError: no examples, an example longer than ``cfg.seq_len`` or without a response, ``cfg.seq_len``
        above the model's ``max_seq_len``, a model without a tokenizer, ``train_layers`` above the model's layer
        count (all before compiling).
    """
    from flax import nnx


    if not examples:
        raise ValueError("finetune needs at least one training example")
    if loaded.tokenizer is None:
        raise ValueError(f"model {loaded.source} has no tokenizer; the run folder needs tokenizer.json")
    for i, ex in enumerate(examples):
        if ex.num_tokens > cfg.seq_len or not ex.response:
            raise ValueError(f"training example {i} has {ex.num_tokens} tokens (seq_len={cfg.seq_len}) and "
                             f"{len(ex.response)} response tokens; each needs a response and at most seq_len tokens")
    window = max(len(ex.response) for ex in examples) + 1
    order = np.random.default_rng(cfg.seed).permutation(len(examples))

    rows = 2 * cfg.batch_size if cfg.modes == "full+block" else cfg.batch_size

    def batch(step: int) -> dict[str, np.ndarray]:
        idx = [order[(step * cfg.batch_size + i) % len(order)] for i in range(cfg.batch_size)]
        if cfg.modes == "full+block":
            return mixed_batch([examples[i] for i in idx], cfg.seq_len)
        full = collate([examples[i] for i in idx], cfg.seq_len)
        return {**full, "is_global": full["segment_ids"] > 0}

    model = add_lora(loaded.model, cfg.lora_rank, seed=cfg.seed) if cfg.lora_rank else loaded.model
    trainable = (top_adapters if cfg.lora_rank else top_layers)(loaded.config.num_layers, cfg.train_layers)
    run_cfg = trainer.RunConfig(
        model=model.config, data=DataConfig(seq_len=cfg.seq_len),
        optimizer=optim.OptimizerConfig(learning_rate=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
                                        weight_decay=0.0, trainable=trainable),
        train=trainer.TrainConfig(steps=cfg.steps, global_batch_size=rows, seed=cfg.seed,
                                  log_every=cfg.log_every, run_dir=str(run_dir)),
        checkpoint=checkpoint.CheckpointConfig(save_every=cfg.save_every, keep=1))
    name = "Block-Attention fine-tuning" if cfg.modes == "full+block" else "fine-tuning"
    task = trainer.Task(MixedBlockLoss(response_window=window), batch, name=name,
                        tokenizer=loaded.tokenizer, progress_keys=("loss_full", "loss_block"))
    extra = {"chat": chat_section(loaded), "finetune": dataclasses.asdict(cfg), **(extra_config or {})}
    return trainer.run(run_cfg, task, init_params=nnx.state(model, nnx.Param), hooks=hooks,
                       extra_config=extra)
