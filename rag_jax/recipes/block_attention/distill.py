"""Block-Attention fine-tuning of a pretrained chat model by self-distillation from its own full attention.

The objective is ``objectives.block_distill.BlockDistillLoss`` (the reasons are there). This module holds what
feeds it and what comes out:

- ``DistillFeatures``: per row (a ``block_rag.BlockExample``), the frozen bottom's output in causal mode and in
  block mode with the chosen shared prefix (``inference.block_prefix``: ``none`` plain block mode, ``sink`` one
  sink shared by all passages: the student trains through the function inference uses), the teacher's hidden
  states after the final norm at the targets, and each target's next-token log-probability under full and block
  attention of the base model; one jitted pass per batch of rows, kept in ``.npz`` files named by a hash of the
  weights, the split and the row (a cache hit is never stale; reruns and later evaluations pay nothing).
- ``distill``: trains the top ``top_layers`` layers (``rag_jax.train.frozen_bottom``) with the one trainer into a
  run folder (resumed when rerun) and returns the full tuned model (``merge_top``).
- ``answer_logprobs``: per-target log-probabilities of any top (base or tuned) from the cached features, in
  block or full mode: the paired log-likelihood evaluation costs ``top_layers / num_layers`` of a forward.
- ``export_hf``: the tuned model as an HF folder with the base model's tokenizer and chat template, which
  ``--model`` (``rag_jax.model.load.load_model``) accepts.

Targets (``target_positions``): every position of the last block and the response but the final token (next
token: question, template or response); not the end of the last passage, which in block mode sees only itself.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rag_jax.atomic import write_bytes
from rag_jax.data.block_rag import BlockExample
from rag_jax.data.pipeline import DataConfig
from rag_jax.inference.block_prefix import (block_parts, bucket_length, part_shapes, prefix_block_residuals,
                                            prefix_length)
from rag_jax.inference.kv_store import model_fingerprint
from rag_jax.model.hf import save_hf
from rag_jax.model.lora import LORA_TRAINABLE, add_lora, merge_lora
from rag_jax.model.transformer import REMAT_POLICIES
from rag_jax.progress import progress_bar
from rag_jax.train import checkpoint, optim, trainer
from rag_jax.train.frozen_bottom import TOP_TRAINABLE, merge_top, split_model
from rag_jax.train.objectives.block_distill import BlockDistillLoss

FEATURE_KEYS = ("full_x", "head_x", "passage_x", "tail_x", "teacher_hidden", "logp_full", "logp_block",
                "prefix_len")
_PART_MULTIPLE = 64  # padded widths of block 0, passages and tail: few compiled shapes


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Attributes:
      top_layers: top decoder layers trained (with the final norm); the rest is the frozen bottom.
      steps: optimizer steps.
      batch_size: rows per step.
      seq_len: rows are right-padded to this many tokens (one compiled shape); longer rows are an error.
      max_targets: target slots per row (padded); a row with more targets is an error.
      full_weight: weight of the full-attention pass's KL (``BlockDistillLoss``); 0 = block pass only.
      prefix: the student's block mode, ``inference.block_prefix.PREFIXES`` (``none``, ``sink``, ``system``).
      learning_rate, warmup_steps: AdamW peak rate (cosine decay to 10%) and linear warmup; no weight decay.
      seed: row order.
      save_every: checkpoint interval in steps (the last step is always saved).
      remat_policy: ``trainer.TrainConfig.remat_policy`` of the top (``"dots"`` or ``"full"`` bound the saved
        activations of a deep top: 29 layers x 4 rows x 960 tokens, both passes, need ~23 GB without).
      lora_rank: 0 trains the top layers' weights and final norm; ``r`` trains rank-``r`` LoRA adapters on every
        projection of the top layers instead (``model.lora``; the weights frozen: no weight gradients, no
        optimizer state for them), folded into the weights at the end (the issue's "LoRA vs top layers").
      length_buckets: False pads every row to ``seq_len`` and every passage to the longest training passage (one
        compiled step); True trains on ``shape_batches`` (rows of similar shapes, each batch padded to its own
        widths; one compiled step per shape, about a dozen), the batches in a seeded order per epoch. The loss
        does not depend on padding, so this changes which rows share a step, not what a row contributes.
      flat_block_pass: with ``prefix="none"``, the block pass as one block-masked forward over the row
        (``BlockDistillLoss``'s flat batch) instead of passages padded to a grid; the same function up to rounding.
    """

    top_layers: int = 8
    steps: int = 200
    batch_size: int = 4
    seq_len: int = 1536
    max_targets: int = 128
    full_weight: float = 1.0
    prefix: str = "none"
    learning_rate: float = 1e-4
    warmup_steps: int = 10
    seed: int = 0
    save_every: int = 25
    remat_policy: str = "none"
    lora_rank: int = 0
    length_buckets: bool = False
    flat_block_pass: bool = False

    def record(self) -> dict:
        """The config as a dict for run identities (recipe hashes, resume checks), without the later fields
        (``lora_rank``, ``length_buckets``, ``flat_block_pass``) when off: earlier run folders keep their names."""
        out = dataclasses.asdict(self)
        return {k: v for k, v in out.items() if v or k not in ("lora_rank", "length_buckets", "flat_block_pass")}

    def __post_init__(self):
        for name in ("top_layers", "steps", "batch_size", "seq_len", "max_targets", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"distill {name}={getattr(self, name)} must be >= 1")
        if self.lora_rank < 0:
            raise ValueError(f"distill lora_rank={self.lora_rank} must be >= 0 (0 = train the weights)")
        if not self.full_weight >= 0:
            raise ValueError(f"distill full_weight={self.full_weight} must be >= 0")
        prefix_length(self.prefix, 1)
        if self.prefix == "nosink":
            raise ValueError("distill prefix='nosink' is a training-free correction (distill_batch encodes no hidden "
                             "tokens); train with none, sink or system")
        if not self.learning_rate > 0:
            raise ValueError(f"distill learning_rate={self.learning_rate} must be > 0")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"distill remat_policy={self.remat_policy!r}; valid: {REMAT_POLICIES}")
        if self.flat_block_pass and self.prefix != "none":
            raise ValueError(f"distill flat_block_pass needs prefix='none' (got {self.prefix!r}): a shared prefix "
                             "is encoded before every passage, which one forward over the row does not do")


def target_positions(example: BlockExample) -> tuple[np.ndarray, np.ndarray]:
    """``(positions, is_response)``: int32 positions ``t`` of the last block and the response whose next token
    ``t + 1`` exists (``t`` in ``[start of the last block, num_tokens - 2]``), and bool: token ``t + 1`` is a
    response token. Raises ValueError for an example with a one-token last block and no response (no target)."""
    n = example.num_tokens
    start = n - len(example.blocks[-1]) - len(example.response)
    positions = np.arange(start, n - 1, dtype=np.int32)
    if positions.size == 0:
        raise ValueError("example has no target: its last block and response hold a single token")
    return positions, positions + 1 >= n - len(example.response)


def row_arrays(example: BlockExample, seq_len: int, *, is_global: bool = False) -> dict[str, np.ndarray]:
    """``tokens``, ``positions``, ``segment_ids`` ``[seq_len]`` of the whole row (``BlockExample.to_arrays``), and
    its bool ``is_global`` (the last block and response: block mode's global tokens) if asked."""
    arrays = example.to_arrays(seq_len)
    return {k: arrays[k] for k in ("tokens", "positions", "segment_ids", *(("is_global",) if is_global else ()))}


@functools.partial(jax.jit, static_argnames=("bottom_def", "top_def", "block_logp"))
def _features(bottom_def, bottom_state, top_def, top_state, tokens, positions, segment_ids, index, parts, tail_index,
              block_logp: bool = True):
    """One batch of rows -> (full_x ``[B, S, hidden]``, head_x, passage_x, tail_x (``block_parts`` shapes + hidden),
    teacher_hidden ``[B, G, hidden]``, logp_full, logp_block ``[B, G]``), float32; without ``block_logp`` the
    top's block-mode pass is skipped and logp_block is NaN (training rows: the loss reads only the rest)."""
    bottom, top = nnx.merge(bottom_def, bottom_state), nnx.merge(top_def, top_state)
    full_x = bottom.residual(tokens, positions, segment_ids, mode="causal")
    block_x = prefix_block_residuals(bottom, parts)
    h_full = _at(top(tokens, positions, segment_ids, mode="causal", inputs_embeds=full_x).hidden, index)
    if block_logp:
        h_block = _at(top.final_norm(prefix_block_residuals(top, parts, block_x)[2]), tail_index)
        logp_block = _next_logp(top, h_block, parts["tail_tokens"], tail_index)
    else:
        logp_block = jnp.full(index.shape, jnp.nan, jnp.float32)
    f32 = (lambda x: x.astype(jnp.float32))
    return (f32(full_x), *map(f32, block_x), f32(h_full), _next_logp(top, h_full, tokens, index), logp_block)


def _at(hidden, index):
    return jnp.take_along_axis(hidden, index[:, :, None], axis=1)


def _next_logp(top, hidden, tokens, index):
    """log p(tokens[index + 1]) from ``hidden`` at ``index`` ``[B, G, hidden]`` -> float32 ``[B, G]``."""
    logp = jax.nn.log_softmax(top.logits(hidden), axis=-1)
    nxt = jnp.take_along_axis(tokens, jnp.minimum(index + 1, tokens.shape[1] - 1), axis=1)
    return jnp.take_along_axis(logp, nxt[:, :, None], axis=-1)[:, :, 0]


@functools.partial(jax.jit, static_argnames=("top_def", "mode"))
def _top_logp(top_def, top_state, batch, mode):
    top = nnx.merge(top_def, top_state)
    if mode == "full":
        hidden = top(batch["tokens"], batch["positions"], batch["segment_ids"], mode="causal",
                     inputs_embeds=batch["full_inputs_embeds"]).hidden
        return _next_logp(top, _at(hidden, batch["target_index"]), batch["tokens"], batch["target_index"])
    embeds = (batch["head_inputs_embeds"], batch["passage_inputs_embeds"], batch["tail_inputs_embeds"])
    tail_x = prefix_block_residuals(top, batch, embeds)[2]
    return _next_logp(top, _at(top.final_norm(tail_x), batch["tail_index"]), batch["tail_tokens"],
                      batch["tail_index"])


class DistillFeatures:
    """Cached per-row inputs of ``BlockDistillLoss`` and of the log-likelihood evaluation (module docstring).

    A snapshot of ``model``'s weights at construction: the bottom and top are new modules over the same arrays
    and the cache keys hash those arrays, so a later in-place update of ``model`` (``nnx.update``) changes
    neither what this object computes nor what its files are valid for; build a new one for the new weights.

    Args:
      model: the base ``Transformer`` (teacher, and the student's starting point); tied embeddings.
      top_layers: layers of the trained top (``frozen_bottom.split_model``).
      prefix: the block mode (``inference.block_prefix.PREFIXES``) of the block features and ``logp_block``.
      cache_dir: folder of the per-row ``.npz`` files (None: memory only).
      batch_tokens: padded tokens per forward.

    Raises:
      ValueError: untied embeddings (the teacher's logits are read through the student's head, which must be
        the frozen embedding), ``top_layers`` outside ``[1, num_layers)``, or an unknown prefix.
    """

    def __init__(self, model, top_layers: int, *, prefix: str = "none", cache_dir: str | os.PathLike | None = None,
                 batch_tokens: int = 8192):
        prefix_length(prefix, 1)

        if not model.config.tie_embeddings:
            raise ValueError("Block-Attention distillation needs tied embeddings: the teacher's logits are read "
                             "through the student's output head, which must stay the frozen embedding")
        self.model = model
        self.bottom, self.top = split_model(model, top_layers)
        self.top_layers, self.prefix = top_layers, prefix
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self.batch_tokens = batch_tokens
        self.fingerprint = hashlib.sha256(f"{model_fingerprint(model, model.config)}/top{top_layers}/{prefix}".encode()
                                          ).hexdigest()
        self._rows: dict[str, dict[str, np.ndarray]] = {}

    def key(self, example: BlockExample) -> str:
        """The row's cache key: the base model's weights, the split and the row's token ids and block bounds."""
        bounds = [len(b) for b in example.blocks] + [len(example.response)]
        return hashlib.sha256(json.dumps([self.fingerprint, example.prompt, list(example.response), bounds]).encode()
                              ).hexdigest()[:32]

    def compute(self, examples: Sequence[BlockExample], *, desc: str = "distillation features",
                progress: bool = True, block_logp: bool = True) -> list[dict[str, np.ndarray]]:
        """The features of every example (``FEATURE_KEYS``, float32: ``full_x`` ``[n, hidden]`` (causal),
        ``head_x`` / ``passage_x`` / ``tail_x`` ``[tokens, hidden]`` (block 0, the passages concatenated, the last
        block + response; ``prefix_block_residuals`` of the bottom), ``teacher_hidden`` ``[g, hidden]``,
        ``logp_full`` / ``logp_block`` ``[g]`` for the ``g`` targets of ``target_positions``; int32 ``prefix_len``),
        computing the rows found neither in memory nor in ``cache_dir``. ``block_logp=False`` (training rows)
        skips the top's block-mode pass, ~45% of a row's compute with an all-layer top: ``logp_block`` is then NaN,
        and a row cached that way is recomputed when a later call needs it."""

        todo = []
        for ex in examples:
            k = self.key(ex)
            if k not in self._rows:
                path = self._path(k)
                if path is not None and path.is_file():
                    with np.load(path) as f:
                        self._rows[k] = {name: f[name] for name in FEATURE_KEYS}
            if k not in self._rows or (block_logp and np.isnan(self._rows[k]["logp_block"]).any()):
                todo.append(ex)
        todo = list({self.key(ex): ex for ex in todo}.values())
        bottom_def, bottom_state = nnx.split(self.bottom)
        top_def, top_state = nnx.split(self.top)
        rows_per_batch = max(1, self.batch_tokens // self._width(max([ex.num_tokens for ex in todo], default=1)))
        g = _round_up(max([len(target_positions(ex)[0]) for ex in todo], default=1), 16)
        with progress_bar(total=len(todo), desc=desc, unit="row", enabled=progress) as bar:
            for idx, width, shapes in shape_batches(todo, rows_per_batch, self.model.config.max_seq_len):
                chunk = [todo[i] for i in idx]
                batch = _stack([row_arrays(ex, width) for ex in chunk], rows_per_batch)
                index = np.zeros((rows_per_batch, g), np.int32)
                tail_index = np.zeros((rows_per_batch, g), np.int32)
                for i, ex in enumerate(chunk):
                    t = target_positions(ex)[0]
                    index[i, :len(t)], tail_index[i, :len(t)] = t, np.arange(len(t))
                parts = block_parts(chunk, self.prefix, shapes)
                parts = {k: np.concatenate([v, np.zeros((rows_per_batch - len(chunk), *v.shape[1:]), v.dtype)])
                         for k, v in parts.items()}
                out = [np.asarray(x) for x in _features(bottom_def, bottom_state, top_def, top_state,
                                                        batch["tokens"], batch["positions"], batch["segment_ids"],
                                                        index, parts, tail_index, block_logp)]
                for i, ex in enumerate(chunk):
                    n, g_i = ex.num_tokens, len(target_positions(ex)[0])
                    lens = [len(b) for b in ex.blocks[1:-1]]
                    row = dict(zip(FEATURE_KEYS, (
                        out[0][i, :n], out[1][i, :len(ex.blocks[0])],
                        np.concatenate([out[2][i, j, :m] for j, m in enumerate(lens)] or [out[2][i, 0, :0]]),
                        out[3][i, :n - sum(lens) - len(ex.blocks[0])], out[4][i, :g_i], out[5][i, :g_i],
                        out[6][i, :g_i], parts["prefix_len"][i])))
                    k = self.key(ex)
                    self._rows[k] = row
                    if self.cache_dir is not None:
                        buf = io.BytesIO()
                        np.savez(buf, **row)
                        write_bytes(self._path(k), buf.getvalue())
                bar.update(len(chunk))
        return [self._rows[self.key(ex)] for ex in examples]

    def _width(self, n: int) -> int:
        return _row_width(n, self.model.config.max_seq_len)

    def _path(self, key: str) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / f"{key}.npz"


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _row_width(n: int, max_seq_len: int) -> int:
    """Padded row length: a multiple of 256 tokens (few compiled shapes), at most the model's maximum."""
    return min(bucket_length(n, 256), max(n, max_seq_len))


def _passage_width(n: int) -> int:
    """Padded passage length: ``bucket_length(n, 64)`` (few compiled shapes)."""
    return bucket_length(n, 64)


def shape_batches(examples: Sequence[BlockExample], batch_size: int, max_seq_len: int, *, fill: bool = False):
    """Batches of at most ``batch_size`` examples of similar padded shapes -> list of ``(indices, width,
    shapes)``: ``width`` the row length (``_row_width`` of the batch's longest row), ``shapes`` the
    ``block_parts`` shapes (block 0, passage count and last block + response as for all ``examples``; the passage
    width from the batch's longest passage, ``_passage_width``). Examples are ordered by their longest passage,
    then length: one long passage pads only its own batch (NQ-open rows: 1.9x fewer padded tokens than one shape
    for all), and a dataset needs about a dozen compiled shapes. ``fill``: the last batch, if short, is the last
    ``batch_size`` examples of that order (a few also in the batch before it), so every batch is full."""

    if not examples:
        return []
    common = part_shapes(examples, _PART_MULTIPLE)
    longest = [max([len(b) for b in ex.blocks[1:-1]] or [1]) for ex in examples]
    order = sorted(range(len(examples)), key=lambda i: (_passage_width(longest[i]), examples[i].num_tokens))
    out = []
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        if fill and len(idx) < batch_size <= len(order):
            idx = order[-batch_size:]
        width = _row_width(max(examples[i].num_tokens for i in idx), max_seq_len)
        out.append((idx, width, {**common, "passage_len": _passage_width(max(longest[i] for i in idx))}))
    return out


def _stack(rows: Sequence[dict[str, np.ndarray]], height: int) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows] + [np.zeros_like(rows[0][k])] * (height - len(rows)))
            for k in rows[0]}


def distill_batch(examples: Sequence[BlockExample], features: Sequence[dict], seq_len: int, max_targets: int,
                  shapes: dict[str, int] | None = None, *, full: bool = True, flat: bool = False
                  ) -> dict[str, np.ndarray]:
    """The ``BlockDistillLoss`` batch of ``examples`` with their ``DistillFeatures.compute`` rows: the whole rows
    right-padded to ``seq_len`` tokens (with ``full_inputs_embeds`` if ``full``), their ``block_parts`` (in the
    features' prefix) padded to ``shapes`` (default: the smallest that hold them) with ``head_`` / ``passage_`` /
    ``tail_inputs_embeds``, and ``max_targets`` target slots. ``flat`` (features of prefix ``none``): the block
    pass's inputs as ``is_global`` and ``block_inputs_embeds`` over the whole row instead of the parts.

    Raises:
      ValueError: an example longer than ``seq_len``, with more than ``max_targets`` targets, or not fitting
        ``shapes``.
    """
    hidden = features[0]["full_x"].shape[1]
    b = len(examples)
    if flat and any(int(f["prefix_len"]) for f in features):
        raise ValueError("distill_batch flat=True needs features of prefix 'none' (no shared prefix)")
    out = _stack([row_arrays(ex, seq_len, is_global=flat) for ex in examples], b)
    if flat:
        out["block_inputs_embeds"] = np.zeros((b, seq_len, hidden), np.float32)
    else:
        out.update(block_parts(examples, "none", shapes or part_shapes(examples, _PART_MULTIPLE)))
        out["prefix_len"] = np.asarray([f["prefix_len"] for f in features], np.int32)
        for part in ("head", "passage", "tail"):
            out[f"{part}_inputs_embeds"] = np.zeros((*out[f"{part}_tokens"].shape, hidden), np.float32)
    if full:
        out["full_inputs_embeds"] = np.zeros((b, seq_len, hidden), np.float32)
    for key in ("target_index", "tail_index"):
        out[key] = np.zeros((b, max_targets), np.int32)
    out["target_mask"] = np.zeros((b, max_targets), np.float32)
    out["teacher_hidden"] = np.zeros((b, max_targets, hidden), np.float32)
    for i, (ex, f) in enumerate(zip(examples, features)):
        t = target_positions(ex)[0]
        if ex.num_tokens > seq_len or len(t) > max_targets:
            raise ValueError(f"distillation row {i} has {ex.num_tokens} tokens and {len(t)} targets; seq_len="
                             f"{seq_len} and max_targets={max_targets} must hold them (raise them or drop the row)")
        if full:
            out["full_inputs_embeds"][i, :ex.num_tokens] = f["full_x"]
        if flat:
            out["block_inputs_embeds"][i, :ex.num_tokens] = np.concatenate([f["head_x"], f["passage_x"], f["tail_x"]])
        else:
            out["head_inputs_embeds"][i, :len(ex.blocks[0])] = f["head_x"]
            start = 0
            for j, block in enumerate(ex.blocks[1:-1]):
                out["passage_inputs_embeds"][i, j, :len(block)] = f["passage_x"][start:start + len(block)]
                start += len(block)
            out["tail_inputs_embeds"][i, :len(f["tail_x"])] = f["tail_x"]
        out["target_index"][i, :len(t)], out["tail_index"][i, :len(t)] = t, np.arange(len(t))
        out["target_mask"][i, :len(t)] = 1.0
        out["teacher_hidden"][i, :len(t)] = f["teacher_hidden"]
    return out


def answer_logprobs(top, examples: Sequence[BlockExample], features: Sequence[dict], mode: str, *,
                    batch_size: int = 4) -> list[np.ndarray]:
    """Per example, float32 ``[g]``: log p(next token) at its targets under ``top`` (a top model of the same
    split, base or tuned) in ``mode`` (``"block"``, in the features' prefix, or ``"full"``), from the cached
    bottom outputs.

    Raises:
      ValueError: unknown mode.
    """
    if mode not in ("block", "full"):
        raise ValueError(f"mode={mode!r}; valid: block, full")
    top_def, top_state = nnx.split(top)
    by_index = {}
    g = _round_up(max(len(target_positions(ex)[0]) for ex in examples), 16)
    for idx, width, shapes in shape_batches(examples, batch_size, top.config.max_seq_len):
        exs = [examples[i] for i in idx] + [examples[idx[0]]] * (batch_size - len(idx))  # one batch size
        batch = distill_batch(exs, [features[i] for i in idx] + [features[idx[0]]] * (batch_size - len(idx)),
                              width, g, shapes, full=(mode == "full"))
        logp = np.asarray(_top_logp(top_def, top_state, {k: v for k, v in batch.items() if k != "teacher_hidden"},
                                    mode))
        for j, i in enumerate(idx):
            by_index[int(i)] = logp[j, :len(target_positions(examples[i])[0])]
    return [by_index[i] for i in range(len(examples))]


def answer_loglik(examples: Sequence[BlockExample], logprobs: Sequence[np.ndarray], *,
                  drop_last: int = 1) -> np.ndarray:
    """float64 ``[n]``: the response's teacher-forced log-likelihood per example (sum over its response tokens
    of ``logprobs``), without the last ``drop_last`` response tokens (default 1: the end-of-turn token)."""
    out = []
    for ex, lp in zip(examples, logprobs):
        is_resp = target_positions(ex)[1]
        keep = np.flatnonzero(is_resp)
        keep = keep[:len(keep) - drop_last] if drop_last else keep
        out.append(float(np.sum(lp[keep], dtype=np.float64)))
    return np.asarray(out, np.float64)


def distill(loaded, examples: Sequence[BlockExample], cfg: DistillConfig, run_dir: str | os.PathLike, *,
            features: DistillFeatures | None = None, extra_config: dict | None = None, hooks=()):
    """Train the top ``cfg.top_layers`` layers of ``loaded.model`` by ``BlockDistillLoss`` into ``run_dir``
    (resumed when it holds checkpoints of the same run) -> ``(tuned full Transformer, trainer.TrainResult)``.

    Raises:
      ValueError: no examples, a row longer than ``cfg.seq_len`` or with more than ``cfg.max_targets`` targets,
        untied embeddings (all before compiling).
    """

    if not examples:
        raise ValueError("distill needs at least one training example")
    for i, ex in enumerate(examples):
        g = len(target_positions(ex)[0])
        if ex.num_tokens > cfg.seq_len or g > cfg.max_targets:
            raise ValueError(f"training row {i} has {ex.num_tokens} tokens and {g} targets; seq_len={cfg.seq_len} "
                             f"and max_targets={cfg.max_targets} must hold them")
    features = features or DistillFeatures(loaded.model, cfg.top_layers, prefix=cfg.prefix)
    if (features.top_layers, features.prefix) != (cfg.top_layers, cfg.prefix):
        raise ValueError(f"features of top_layers={features.top_layers}, prefix={features.prefix!r} do not match "
                         f"the config's top_layers={cfg.top_layers}, prefix={cfg.prefix!r}")
    feats = features.compute(examples, desc="distillation features (train)", block_logp=False)
    shapes = part_shapes(examples, _PART_MULTIPLE)
    order = np.random.default_rng(cfg.seed).permutation(len(examples))
    full = cfg.full_weight > 0

    groups = shape_batches(examples, cfg.batch_size, cfg.seq_len, fill=True) if cfg.length_buckets else []

    def batch(step: int) -> dict[str, np.ndarray]:
        if groups:
            epoch, i = divmod(step, len(groups))
            idx, width, group_shapes = groups[np.random.default_rng([cfg.seed, epoch]).permutation(len(groups))[i]]
            return distill_batch([examples[j] for j in idx], [feats[j] for j in idx], width, cfg.max_targets,
                                 group_shapes, full=full, flat=cfg.flat_block_pass)
        idx = [int(order[(step * cfg.batch_size + i) % len(order)]) for i in range(cfg.batch_size)]
        return distill_batch([examples[i] for i in idx], [feats[i] for i in idx], cfg.seq_len, cfg.max_targets,
                             shapes, full=full, flat=cfg.flat_block_pass)

    top = add_lora(features.top, cfg.lora_rank, seed=cfg.seed) if cfg.lora_rank else features.top
    run_cfg = trainer.RunConfig(
        model=top.config, data=DataConfig(seq_len=cfg.seq_len),
        optimizer=optim.OptimizerConfig(learning_rate=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
                                        weight_decay=0.0,
                                        trainable=LORA_TRAINABLE if cfg.lora_rank else TOP_TRAINABLE),
        train=trainer.TrainConfig(steps=cfg.steps, global_batch_size=cfg.batch_size, seed=cfg.seed, log_every=1,
                                  run_dir=str(run_dir), remat_policy=cfg.remat_policy),
        checkpoint=checkpoint.CheckpointConfig(save_every=cfg.save_every, keep=1),
        logging=trainer.LoggingConfig(tensorboard=False))
    task = trainer.Task(BlockDistillLoss(full_weight=cfg.full_weight), batch, name="Block-Attention distillation",
                        progress_keys=("kl_block", "kl_full"))
    extra = {"distill": cfg.record(), "base_fingerprint": features.fingerprint, **(extra_config or {})}
    result = trainer.run(run_cfg, task, init_params=nnx.state(top, nnx.Param), hooks=hooks, extra_config=extra)
    trained = merge_lora(nnx.merge(result.graphdef, result.state.params))
    return merge_top(loaded.model, nnx.state(trained, nnx.Param)), result


def export_hf(loaded, model, path: str | os.PathLike, *, prefix: str = "none") -> Path:
    """Write ``model`` (e.g. the tuned model) as an HF folder with ``loaded``'s tokenizer, chat template, special
    tokens and end ids, so ``load_model(path)`` prompts it as the base model, and ``block_attention.json`` naming
    the block mode it was tuned for (``LoadedModel.block_prefix``; atomic, ``hf.save_hf``)."""

    extra = {"block_attention.json": json.dumps({"prefix": prefix})}
    if loaded.tokenizer is not None:
        extra["tokenizer.json"] = loaded.tokenizer.to_str()
    tok_cfg = {**loaded.special_tokens, "tokenizer_class": "PreTrainedTokenizerFast",
               "model_max_length": model.config.max_seq_len}
    if loaded.chat_template:
        tok_cfg["chat_template"] = loaded.chat_template
    extra["tokenizer_config.json"] = json.dumps(tok_cfg, indent=2, ensure_ascii=False)
    if loaded.eos_ids:
        extra["generation_config.json"] = json.dumps({"eos_token_id": list(loaded.eos_ids)}, indent=2)
    return save_hf(model, path, loaded.arch, extra_files=extra, overwrite=True)
