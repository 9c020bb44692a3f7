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
frozen bottom's outputs in each mode, computed once per row. Its block pass is
``inference.block_prefix.prefix_block_residuals``, the computation Block-Attention inference does (passages
encoded apart, after an optional shared prefix, their KV re-encoded to their offsets, the last block attending
to all of it), so training and deployment see the same attention. The teacher's logits are read through the
student's own output head from the teacher's hidden states after the final norm (``teacher_hidden``), which is
exact because the head is the tied, frozen embedding (``frozen_bottom.TOP_TRAINABLE``).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from rag_jax.inference.block_prefix import PART_KEYS, prefix_block_residuals
from rag_jax.train.objectives.nll import distill_kl

DISTILL_BATCH_KEYS = PART_KEYS + ("head_inputs_embeds", "passage_inputs_embeds", "tail_inputs_embeds",
                                  "tail_index", "target_mask", "teacher_hidden")
FLAT_BATCH_KEYS = ("tokens", "positions", "segment_ids", "is_global", "block_inputs_embeds", "target_index",
                   "target_mask", "teacher_hidden")
FULL_BATCH_KEYS = ("tokens", "positions", "segment_ids", "full_inputs_embeds", "target_index")


@dataclasses.dataclass(frozen=True)
class BlockDistillLoss:
    """Hashable objective for the train step: ``BlockDistillLoss()(top_model, batch, rng)``.

    Batch (``rag_jax.recipes.block_attention.distill.distill_batch``), B rows, G target slots:
      the block pass: ``block_parts``' int32 arrays (``PART_KEYS``) and float32 ``head_`` / ``passage_`` /
      ``tail_inputs_embeds`` (the frozen bottom's ``prefix_block_residuals``), ``tail_index`` int32 ``[B, G]``
      (target positions in the tail);
      the full pass (``full_weight > 0``): ``tokens``, ``positions``, ``segment_ids`` int32 ``[B, S]`` (0 =
      padding), ``full_inputs_embeds`` float32 ``[B, S, hidden]`` (the bottom's causal output), ``target_index``
      int32 ``[B, G]`` (the same targets in the whole row);
      both: ``target_mask`` ``[B, G]`` (1 = a real target), ``teacher_hidden`` float32 ``[B, G, hidden]``.
      Or, for plain block mode (no shared prefix), the block pass as one forward over the whole row under the
      block mask (Block-Attention's training form, §2.2: no per-passage padding): ``is_global`` bool ``[B, S]``
      and ``block_inputs_embeds`` float32 ``[B, S, hidden]`` (the bottom's block-mode output in row order)
      instead of the part arrays; the same function (RoPE is relative: passages at their offsets or encoded
      at 0 and re-encoded agree up to rounding).

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
        flat = "block_inputs_embeds" in batch
        keys = (FLAT_BATCH_KEYS if flat else DISTILL_BATCH_KEYS) + (FULL_BATCH_KEYS if self.full_weight > 0 else ())
        missing = [k for k in keys if k not in batch]
        if missing:
            raise ValueError(f"Block-Attention distillation batch is missing {missing}; it has {sorted(batch)} "
                             "(see rag_jax.recipes.block_attention.distill.distill_batch)")
        mask = batch["target_mask"]
        teacher = model.logits(batch["teacher_hidden"])

        def kl(hidden, index):
            return distill_kl(model.logits(jnp.take_along_axis(hidden, index[:, :, None], axis=1)), teacher, mask)

        if flat:
            kl_block = kl(model(batch["tokens"], batch["positions"], batch["segment_ids"], mode="block",
                                is_global=batch["is_global"], inputs_embeds=batch["block_inputs_embeds"]).hidden,
                          batch["target_index"])
        else:
            embeds = (batch["head_inputs_embeds"], batch["passage_inputs_embeds"], batch["tail_inputs_embeds"])
            kl_block = kl(model.final_norm(prefix_block_residuals(model, batch, embeds)[2]), batch["tail_index"])
        if self.full_weight > 0:
            hidden = model(batch["tokens"], batch["positions"], batch["segment_ids"], mode="causal",
                           inputs_embeds=batch["full_inputs_embeds"]).hidden
            kl_full = kl(hidden, batch["target_index"])
        else:
            kl_full = jnp.zeros((), jnp.float32)
        loss = (kl_block + self.full_weight * kl_full) / (1.0 + self.full_weight)
        return loss, {"loss": loss, "kl_block": kl_block, "kl_full": kl_full,
                      "num_targets": jnp.sum(mask != 0).astype(jnp.float32)}
