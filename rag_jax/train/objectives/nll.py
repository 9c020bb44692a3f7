"""The one next-token cross-entropy and the one distillation KL, shared by every objective (LM, Block-Attention,
GRIT's generative loss, Block-Attention distillation)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from rag_jax import sharding


def next_token_nll(logits: jax.Array, tokens: jax.Array, target_weights: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-row weighted next-token negative log-likelihood (nats), top-1 hits and weight.

    Args:
      logits: float ``[batch, seq, vocab]``; position t predicts token t+1.
      tokens: int ``[batch, seq]``.
      target_weights: ``[batch, seq - 1]`` weight of predicting ``tokens[:, t + 1]`` (0 = not a target).

    Returns:
      float32 ``(nll_sum [batch], correct_sum [batch], weight_sum [batch])``; the objectives reduce them
      (token mean, per-sub-batch mean).

    The ``[batch, seq, vocab]`` logits are the largest activation: the sharding hint keeps GSPMD from leaving
    them unsharded on large FSDP meshes (a no-op outside the train step's ``activation_rules`` context).
    """
    logits = sharding.constrain(logits, ("batch", "seq", "vocab"))[:, :-1].astype(jnp.float32)
    targets = tokens[:, 1:]
    w = target_weights.astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    hits = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return jnp.sum(nll * w, axis=-1), jnp.sum(hits * w, axis=-1), jnp.sum(w, axis=-1)


def distill_kl(logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Token-mean ``KL(softmax(teacher) ‖ softmax(logits))`` over the positions where ``mask`` is nonzero (nats).

    Args:
      logits: float ``[B, L, vocab]`` of the trained model.
      teacher_logits: float ``[B, L, vocab]`` of the frozen teacher (no gradient flows into it).
      mask: ``[B, L]``, nonzero at the positions counted.

    Returns:
      float32 scalar (0 when ``mask`` is all zero).

    Raises:
      ValueError: shapes that do not agree.
    """
    if logits.shape != teacher_logits.shape or tuple(mask.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"logits {tuple(logits.shape)}, teacher_logits {tuple(teacher_logits.shape)} and mask "
                         f"{tuple(mask.shape)} must agree on [batch, seq(, vocab)]")
    log_p = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits).astype(jnp.float32), axis=-1)
    log_q = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    m = (mask != 0).astype(jnp.float32)
    return jnp.sum(kl * m) / jnp.maximum(m.sum(), 1.0)
