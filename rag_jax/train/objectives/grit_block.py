"""GRIT's joint objective with Block-Attention fine-tuning as the generative loss.

GritLM (ICLR 2025) Eq. 3: ``L = L_Rep + λ·L_Gen``. Here ``L_Rep`` is the contrastive loss in bidirectional
embedding mode (``rag_jax.train.objectives.grit.GritLoss``, ``mode="embedding"``) and ``L_Gen`` the
Block-Attention loss (Block-Attention, ICLR 2025, §2.2-2.4; ``rag_jax.train.objectives.block.BlockLoss``)
on RAG prompts trained in full and in block mode. One batch holds both sets of keys
(``rag_jax.data.phantom_rag.RagTrainingSet``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from rag_jax.train.objectives.block import BLOCK_BATCH_KEYS
from rag_jax.train.objectives.grit import EMBEDDING_KEYS


@dataclasses.dataclass(frozen=True)
class GritBlockLoss:
    """GRIT Eq. 3 with the Block-Attention loss as ``L_Gen``: ``L_Rep + gen_weight · L_Block``.

    Hashable (a static argument of the train step). Returns ``(loss, metrics)`` with ``loss``, ``loss_rep``,
    ``rep_accuracy``, ``loss_full``, ``loss_block``, ``gen_accuracy`` (float32 scalars)."""

    grit: Any  # rag_jax.train.objectives.grit.GritLoss (mode="embedding")
    block: Any  # rag_jax.train.objectives.block.BlockLoss
    gen_weight: float = 1.0

    def __call__(self, model, batch, rng=None):
        loss_rep, rep = self.grit(model, {k: batch[k] for k in EMBEDDING_KEYS}, rng)
        loss_gen, gen = self.block(model, {k: batch[k] for k in BLOCK_BATCH_KEYS}, rng)
        loss = loss_rep + self.gen_weight * loss_gen
        return loss, {"loss": loss, "loss_rep": loss_rep, "rep_accuracy": rep["rep_accuracy"],
                      "loss_full": gen["loss_full"], "loss_block": gen["loss_block"], "gen_accuracy": gen["accuracy"]}

