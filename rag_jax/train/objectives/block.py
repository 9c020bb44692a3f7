"""Block-Attention fine-tuning objective (Ma, Wang, Lan, ICLR 2025, §2.2-2.4; research note
``shared/research/block_attention.md`` §1.2 and §1.4).

Each row is one example from ``rag_jax.data.block_rag`` (right-padded): ``segment_ids`` number the
blocks, ``is_global`` marks the last block and the response, ``loss_mask`` the response tokens.
Every row is trained in both modes, as the v5 recipe does ("each sample in BOTH full and block
mode", ``train_full_attention=true``):

- **block mode**: the core's ``mode="block"`` mask, ``(k <= q) & (seg_q == seg_k | is_global_q)``,
  i.e. causal inside every local block and causal over everything for the last block + response;
  global positions 0..N-1 (the trainer passes no position ids, note §1.2). With ``marker_ids`` the
  ids of ``"[Block-Attention]"`` are prepended to block 0 (local, no loss), as the v5 script does
  with ``--add_special_domain_tokens``; inference must then prepend them too
  (``rag_jax.inference.block_attention``), unlike the reference server (note §1.8, defect 2).
- **full mode**: plain causal attention over the same tokens and positions, no marker.

The loss is the token mean of next-token cross-entropy over response tokens of both passes,
weighted ``full_weight : block_weight`` (default 1:1, which equals training on the duplicated
dataset). A weight of 0 skips that pass (``block_weight=0`` is the full-attention RAG baseline).
The reference sums token losses (``loss reduction sum``); we take the mean so the learning rate does
not scale with batch size, and report ``num_tokens`` so gradient accumulation weights micro-batches.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rag_jax.train.objectives.nll import next_token_nll

BLOCK_BATCH_KEYS = ("tokens", "positions", "segment_ids", "is_global", "loss_mask")


@dataclasses.dataclass(frozen=True)
class BlockLoss:
    """Hashable Block-Attention objective for the train step: ``BlockLoss()(model, batch, rng)``.

    Attributes:
      full_weight: weight of the full-attention pass (>= 0).
      block_weight: weight of the block-attention pass (>= 0); at least one weight must be > 0.
      marker_ids: token ids prepended to block 0 in block mode only (empty: no marker).
    """

    full_weight: float = 1.0
    block_weight: float = 1.0
    marker_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.full_weight < 0 or self.block_weight < 0 or self.full_weight + self.block_weight <= 0:
            raise ValueError(f"full_weight={self.full_weight}, block_weight={self.block_weight}: both must be >= 0 "
                             "and at least one > 0")
        object.__setattr__(self, "marker_ids", tuple(int(i) for i in self.marker_ids))

    def __call__(self, model, batch, rng=None):
        return block_loss(model, batch, rng, full_weight=self.full_weight, block_weight=self.block_weight,
                          marker_ids=self.marker_ids)


def block_loss(model, batch: dict[str, jax.Array], rng: jax.Array | None = None, *, full_weight: float = 1.0,
               block_weight: float = 1.0, marker_ids: tuple[int, ...] = ()
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Weighted token-mean response loss of the full and the block pass (see module docstring).

    Args:
      model: a ``rag_jax.model.Transformer``.
      batch: ``tokens``, ``positions``, ``segment_ids`` int32 ``[batch, seq]`` (0 = padding),
        ``is_global`` bool ``[batch, seq]``, ``loss_mask`` ``[batch, seq]`` (1 on response tokens, the
        prediction OF token t), as produced by ``rag_jax.data.block_rag.collate``.
      rng: unused (deterministic); accepted for the common interface.
      full_weight, block_weight, marker_ids: see ``BlockLoss``.

    Returns:
      ``(loss, {"loss", "loss_full", "loss_block", "accuracy", "num_tokens"})``, float32 scalars
      (the loss of a skipped pass is reported as 0; ``num_tokens`` counts response targets per pass).

    Raises:
      ValueError: a batch key is missing.
    """
    del rng
    missing = [k for k in BLOCK_BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"Block-Attention batch is missing {missing}; it has {sorted(batch)} and needs "
                         f"{list(BLOCK_BATCH_KEYS)} (see rag_jax.data.block_rag.collate)")
    tokens, positions, segment_ids = batch["tokens"], batch["positions"], batch["segment_ids"]
    is_global, loss_mask = batch["is_global"].astype(bool), batch["loss_mask"].astype(jnp.float32)
    zero = jnp.zeros((), jnp.float32)
    sums = {"full": (zero, zero, zero), "block": (zero, zero, zero)}
    if full_weight > 0:
        logits = model(tokens, positions, segment_ids, mode="causal").logits
        sums["full"] = _response_nll(logits, tokens, loss_mask)
    if block_weight > 0:
        if marker_ids:
            tokens, positions, segment_ids, is_global, loss_mask = _prepend_marker(
                marker_ids, tokens, positions, segment_ids, is_global, loss_mask)
        logits = model(tokens, positions, segment_ids, mode="block", is_global=is_global).logits
        sums["block"] = _response_nll(logits, tokens, loss_mask)
    (nll_f, hit_f, n_f), (nll_b, hit_b, n_b) = sums["full"], sums["block"]
    denom = jnp.maximum(full_weight * n_f + block_weight * n_b, 1e-6)
    loss = (full_weight * nll_f + block_weight * nll_b) / denom
    metrics = {
        "loss": loss,
        "loss_full": nll_f / jnp.maximum(n_f, 1.0),
        "loss_block": nll_b / jnp.maximum(n_b, 1.0),
        "accuracy": (full_weight * hit_f + block_weight * hit_b) / denom,
        "num_tokens": jnp.maximum(n_f, n_b),
    }
    return loss, metrics


@dataclasses.dataclass(frozen=True)
class MixedBlockLoss:
    """Block-Attention fine-tuning on a mixed batch (``rag_jax.data.block_rag.mixed_batch``): full rows (every
    token global) and block rows in ONE ``mode="block"`` forward; the token-mean response loss over all rows.

    With the batch of ``mixed_batch`` (each example once per mode) the loss equals ``BlockLoss()`` (weights
    1:1) on the examples, at one model call per step.

    Attributes:
      response_window: if set, logits are computed only on each row's last ``response_window`` real tokens
        (the vocabulary projection of a 49K-token vocabulary is a large share of a small model's step; the
        other rows' logits are dead code under jit). Every row's response plus one token must fit in it
        (e.g. ``max response length + 1``): targets outside the window are not counted.

    Returns ``(loss, {"loss", "loss_full", "loss_block", "accuracy", "num_tokens"})`` (float32 scalars; a row
    is "full" when all its real tokens are global).
    """

    response_window: int | None = None

    def __post_init__(self):
        if self.response_window is not None and self.response_window < 2:
            raise ValueError(f"response_window={self.response_window} must be None or >= 2 tokens "
                             "(a response token and the token before it)")

    def __call__(self, model, batch, rng=None):
        del rng
        missing = [k for k in BLOCK_BATCH_KEYS if k not in batch]
        if missing:
            raise ValueError(f"mixed Block-Attention batch is missing {missing}; it has {sorted(batch)} "
                             "(see rag_jax.data.block_rag.mixed_batch)")
        tokens, segment_ids = batch["tokens"], batch["segment_ids"]
        is_global, loss_mask = batch["is_global"].astype(bool), batch["loss_mask"].astype(jnp.float32)
        hidden = model(tokens, batch["positions"], segment_ids, mode="block", is_global=is_global).hidden
        if self.response_window is not None and self.response_window < tokens.shape[1]:
            w = self.response_window
            length = jnp.sum(segment_ids > 0, axis=1)
            idx = jnp.clip(length - w, 0, tokens.shape[1] - w)[:, None] + jnp.arange(w)
            hidden = jnp.take_along_axis(hidden, idx[:, :, None], axis=1)
            tokens, loss_mask = (jnp.take_along_axis(x, idx, axis=1) for x in (tokens, loss_mask))
        nll, hits, n = next_token_nll(model.logits(hidden), tokens, loss_mask[:, 1:])
        full_row = jnp.all(is_global | (segment_ids == 0), axis=1)
        denom = jnp.maximum(jnp.sum(n), 1.0)
        loss = jnp.sum(nll) / denom

        def part(rows):
            return jnp.sum(jnp.where(rows, nll, 0.0)) / jnp.maximum(jnp.sum(jnp.where(rows, n, 0.0)), 1.0)

        return loss, {"loss": loss, "loss_full": part(full_row), "loss_block": part(~full_row),
                      "accuracy": jnp.sum(hits) / denom, "num_tokens": jnp.sum(n)}


def _response_nll(logits, tokens, loss_mask):
    """(sum of next-token NLL, correct top-1 count, target count) over tokens with ``loss_mask``."""
    return tuple(jnp.sum(x) for x in next_token_nll(logits, tokens, loss_mask[:, 1:]))


def _prepend_marker(marker_ids, tokens, positions, segment_ids, is_global, loss_mask):
    """Prepend the marker to every row, inside block 0 (same segment id as the row's first token).

    Rows are right-padded single examples, so the first token belongs to block 0; positions shift
    by the marker length (global positions 0..N-1 over the marked sequence). An all-padding row
    stays all padding.
    """
    batch, m = tokens.shape[0], len(marker_ids)
    marker = jnp.broadcast_to(jnp.asarray(marker_ids, tokens.dtype), (batch, m))
    first_seg = jnp.broadcast_to(segment_ids[:, :1], (batch, m))
    valid = first_seg != 0
    return (
        jnp.concatenate([marker, tokens], axis=1),
        jnp.concatenate([jnp.where(valid, jnp.arange(m, dtype=positions.dtype), 0),
                         jnp.where(segment_ids != 0, positions + m, positions)], axis=1),
        jnp.concatenate([first_seg, segment_ids], axis=1),
        jnp.concatenate([jnp.zeros((batch, m), bool), is_global], axis=1),
        jnp.concatenate([jnp.zeros((batch, m), loss_mask.dtype), loss_mask], axis=1),
    )
