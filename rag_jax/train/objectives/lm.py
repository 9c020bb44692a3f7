"""Next-token language-modelling loss over causal or packed rows.

Packed rows (several documents in one fixed-length row, told apart by ``segment_ids``) run the core's
``block`` mask with no global tokens, so a token attends only to earlier tokens of its own document
(research note design.md, "Sequence packing in training is the same block mask with no global block").
A prediction counts only when the target token is in the same non-zero segment as the input token,
so the first token of the next document and padding are never targets.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rag_jax.train.objectives.nll import fused_next_token_nll

LM_BATCH_KEYS = ("tokens", "positions", "segment_ids")


def lm_loss(model, batch: dict[str, jax.Array], rng: jax.Array | None = None, *, mode: str = "block"
            ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross-entropy (nats per target token).

    Args:
      model: a ``rag_jax.model.Transformer``.
      batch: ``tokens``, ``positions``, ``segment_ids`` int32 ``[batch, seq]`` (segment 0 = padding) and
        optional ``loss_mask`` ``[batch, seq]`` (0/1, float or int/bool) weighting the prediction OF token t
        (e.g. response tokens only).
      rng: unused (deterministic objective); accepted for the common interface.
      mode: ``"block"`` (packed documents, the default) or ``"causal"`` (one document per row).

    Returns:
      ``(loss, {"loss", "accuracy", "num_tokens"})``, all float32 scalars. With no target token in
      the batch the loss is 0 (not NaN).

    Raises:
      ValueError: a required batch key is missing, or mode is not "block"/"causal".
    """
    del rng
    if mode not in ("block", "causal"):
        raise ValueError(f"LM loss mode={mode!r}; valid: 'block' (packed) or 'causal'")
    missing = [k for k in LM_BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"LM batch is missing {missing}; it has {sorted(batch)} and needs {list(LM_BATCH_KEYS)}")
    tokens, segment_ids = batch["tokens"], batch["segment_ids"]
    hidden = model(tokens, batch["positions"], segment_ids, mode=mode).hidden  # the unused logits are dead code
    weight = ((segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)).astype(jnp.float32)
    if "loss_mask" in batch:
        weight = weight * batch["loss_mask"][:, 1:].astype(jnp.float32)
    # vocab head + cross-entropy fused: no [batch, seq, vocab] logits, gradients formed chunk by chunk
    nll, hits, n = fused_next_token_nll(hidden, model.head_weight(), tokens, weight)
    num_tokens = jnp.sum(n)
    denom = jnp.maximum(num_tokens, 1.0)
    loss, accuracy = nll / denom, jnp.sum(hits) / denom
    return loss, {"loss": loss, "accuracy": accuracy, "num_tokens": num_tokens}


@dataclasses.dataclass(frozen=True)
class LMLoss:
    """Hashable LM objective for the train step: ``LMLoss(mode="causal")(model, batch, rng)``."""

    mode: str = "block"

    def __post_init__(self):
        if self.mode not in ("block", "causal"):
            raise ValueError(f"LMLoss mode={self.mode!r}; valid: 'block' (packed) or 'causal'")

    def __call__(self, model, batch, rng=None):
        return lm_loss(model, batch, rng, mode=self.mode)
