"""The one next-token cross-entropy, shared by every objective (LM, Block-Attention, GRIT's generative loss)."""
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
