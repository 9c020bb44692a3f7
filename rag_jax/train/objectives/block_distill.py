"""Block-Attention fine-tuning by self-distillation from full attention (issue 29).

Block-Attention's recipe (Ma, Wang, Lan, ICLR 2025, §2.4) trains a cross-entropy on the response tokens of each
row, in full and in block mode: a few targets per row. Here the teacher is the frozen base model in **full**
attention and the student the trained model in **block** attention over the same tokens and positions: at every
target position (the last block and the response: question, template and answer) the student matches the
teacher's next-token distribution, ``KL(teacher || student)`` (as GRIT's ``distill_kl``), so each row carries tens
of full distributions instead of a few answer tokens. With ``full_weight > 0`` the student's full-attention pass
is distilled to the same teacher too, the analogue of the paper's 1:1 full/block mix: full attention stays the
base model's.

The student is a top model (``rag_jax.train.frozen_bottom``): only its layers are trained and its inputs are the
frozen bottom's outputs in each mode (``block_inputs_embeds``, ``full_inputs_embeds``), computed once per row.
The teacher's logits are read through the student's own output head from the teacher's hidden states after the
final norm (``teacher_hidden``), which is exact because the head is the tied, frozen embedding
(``frozen_bottom.TOP_TRAINABLE``).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from rag_jax.train.objectives.nll import distill_kl

DISTILL_BATCH_KEYS = ("tokens", "positions", "segment_ids", "is_global", "block_inputs_embeds", "target_index",
                      "target_mask", "teacher_hidden")


@dataclasses.dataclass(frozen=True)
class BlockDistillLoss:
    """Hashable objective for the train step: ``BlockDistillLoss()(top_model, batch, rng)``.

    Batch (``rag_jax.train.block_distill.distill_batch``), B rows of S tokens, G target slots:
      ``tokens``, ``positions``, ``segment_ids`` int32 ``[B, S]`` (0 = padding), ``is_global`` bool ``[B, S]``
      (the last block and the response); ``block_inputs_embeds`` / ``full_inputs_embeds`` float32
      ``[B, S, hidden]`` (the frozen bottom's output in block / causal mode; the full one only with
      ``full_weight > 0``); ``target_index`` int32 ``[B, G]`` (positions whose next-token distribution is
      matched), ``target_mask`` ``[B, G]`` (1 = a real target), ``teacher_hidden`` float32 ``[B, G, hidden]``.

    Attributes:
      full_weight: weight of the full-attention pass's KL (>= 0); the block pass has weight 1.

    Returns ``(loss, {"loss", "kl_block", "kl_full", "num_targets"})``: the loss is
    ``(kl_block + full_weight * kl_full) / (1 + full_weight)``, each a token mean in nats.

    Raises:
      ValueError: a negative ``full_weight``; a batch key missing (at trace time).
    """

    full_weight: float = 1.0

    def __post_init__(self):
        if not self.full_weight >= 0:
            raise ValueError(f"BlockDistillLoss.full_weight={self.full_weight} must be >= 0 (0 = block pass only)")

    def __call__(self, model, batch, rng=None):
        del rng
        keys = DISTILL_BATCH_KEYS + (("full_inputs_embeds",) if self.full_weight > 0 else ())
        missing = [k for k in keys if k not in batch]
        if missing:
            raise ValueError(f"Block-Attention distillation batch is missing {missing}; it has {sorted(batch)} "
                             "(see rag_jax.train.block_distill.distill_batch)")
        tokens, positions, segment_ids = batch["tokens"], batch["positions"], batch["segment_ids"]
        is_global = batch["is_global"].astype(bool)
        index, mask = batch["target_index"], batch["target_mask"]
        teacher = model.logits(batch["teacher_hidden"])

        def kl(mode: str, inputs_embeds):
            hidden = model(tokens, positions, segment_ids, mode=mode, is_global=is_global,
                           inputs_embeds=inputs_embeds).hidden
            hidden = jnp.take_along_axis(hidden, index[:, :, None], axis=1)
            return distill_kl(model.logits(hidden), teacher, mask)

        kl_block = kl("block", batch["block_inputs_embeds"])
        kl_full = kl("causal", batch["full_inputs_embeds"]) if self.full_weight > 0 else jnp.zeros((), jnp.float32)
        loss = (kl_block + self.full_weight * kl_full) / (1.0 + self.full_weight)
        return loss, {"loss": loss, "kl_block": kl_block, "kl_full": kl_full,
                      "num_targets": jnp.sum(mask != 0).astype(jnp.float32)}
