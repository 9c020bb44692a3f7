"""GRIT objective: one model trained for embeddings and generation (GritLM, ICLR 2025, §2, Eqs. 1-3).

``L_GRIT = L_Rep + λ·L_Gen`` (Eq. 3; λ_Rep = 1 and λ_Gen = ``loss_gen_factor`` as in the reference).

- ``L_Rep`` (Eq. 1, reference ``DistributedContrastiveLoss``): InfoNCE over L2-normalized mean-pooled
  bidirectional embeddings (``rag_jax.model.embedding``). Scores are ``q·pᵀ / temperature``
  (τ = 0.02 is a divisor in the code, scale 50; notes §1.1). Passages are laid out per query as
  ``[positive, hard negative, ...]`` (group size G), so query i's positive is column ``i·G`` and every
  other passage in the batch is a negative. The loss is one-directional (query → passage).
- Cross-device negatives: each data-parallel shard all-gathers q and p over the data axes; the
  gathered copies are constants except the shard's own slice (reference: all_gather under no_grad,
  then put the local tensor back in). Without them each shard only sees its own passages.
  Gradient scale: the reference's DDP averages the shard gradients, giving ``(1/W)·∇L_global``
  (notes §1.1). We return the exact ``∇L_global`` instead (the sum of the shard-local gradients),
  so the shard_map path and the plain global computation under ``jit`` agree in value and gradient.
  Alone, the two scales differ under Adam only through ε; in the unified loss the reference's 1/W also
  weights L_Rep against L_Gen (whose DDP average is exact), so its balance corresponds to ours with
  ``loss_gen_factor = W·λ_Gen`` (W = number of data-parallel shards).
- ``L_Gen`` (Eq. 2, reference ``NextTokenLoss``): next-token cross-entropy on response tokens only.
  ``"mixed"`` (GritLM-7B): token-mean within sub-batches of ``gen_sub_batch_size`` samples, then the
  mean over sub-batches ("Mix (32 → 8)", notes §1.2). ``"token"`` (GritLM-8x7B): sum of token
  losses / number of samples.
- ``L_KL`` (ours, off by default; not in GritLM): ``KL(p_teacher ‖ p_model)`` per real position of the
  generative rows, token-mean, weighted by ``gen_kl_factor`` (distillation to a frozen teacher, as in
  Learning without Forgetting, Li & Hoiem 2016). GritLM keeps generation by training on Tülu 2 instruction
  data with all parameters; when a pretrained model is GRIT-tuned on a CPU budget (a few shared top layers,
  a few hundred generative rows), the contrastive loss pulls the shared layers away from the base model's
  generation, and the base model's full next-token distribution at every prompt and response position is
  a denser anchor than hard targets on the response alone.

Both passes run on the same model state inside one jitted train step: the embedding pass
(``mode="bidirectional"``) on queries and passages and the generative pass (``mode="causal"``) on
instruction/response pairs; their losses add, so one gradient covers both (the reference runs two
backward passes whose gradients add, notes §1.3).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

from rag_jax.model.embedding import encode
from rag_jax.train.objectives.nll import distill_kl, next_token_nll

MODES = ("unified", "embedding", "generative")
GEN_REDUCTIONS = ("mixed", "token")


@dataclasses.dataclass(frozen=True)
class GritConfig:
    """Settings of the GRIT objective (reference flags in parentheses, notes §1, §4).

    Attributes:
      mode: ``"unified"`` (both losses), ``"embedding"`` (L_Rep only), ``"generative"`` (L_Gen only).
      temperature: InfoNCE temperature, a divisor of the cosine scores (``--temperature 0.02``).
      loss_gen_type: ``"mixed"`` or ``"token"`` (``--loss_gen_type``).
      loss_gen_factor: λ_Gen (``--loss_gen_factor``; 1.0 for GritLM-7B, 0.003 for 8x7B).
      gen_sub_batch_size: samples per token-mean group for ``"mixed"`` (32 in GritLM-7B);
        ``None`` = the whole generative batch is one group.
      negatives_cross_device: gather negatives over the data-parallel axes (``--negatives_cross_device``).
      data_axes: mesh axes the batch is sharded over.
      gen_window: if set, output logits are computed only on each generative row's last ``gen_window`` real
        tokens (the vocabulary projection dominates a small model's generative pass); every row's targets
        plus the token before them must fit in it, targets outside are not counted. None = every position.
    """

    mode: str = "unified"
    temperature: float = 0.02
    loss_gen_type: str = "mixed"
    loss_gen_factor: float = 1.0
    gen_sub_batch_size: int | None = None
    negatives_cross_device: bool = True
    data_axes: tuple[str, ...] = ("data", "fsdp")
    gen_window: int | None = None
    gen_kl_factor: float = 0.0

    def __post_init__(self):
        if self.gen_window is not None and self.gen_window < 2:
            raise ValueError(f"GritConfig.gen_window={self.gen_window} must be None or >= 2 tokens")
        if self.mode not in MODES:
            raise ValueError(f"GritConfig.mode={self.mode!r}; valid: {MODES}")
        if self.loss_gen_type not in GEN_REDUCTIONS:
            raise ValueError(f"GritConfig.loss_gen_type={self.loss_gen_type!r}; valid: {GEN_REDUCTIONS}")
        if not self.temperature > 0:
            raise ValueError(f"GritConfig.temperature={self.temperature} must be > 0")
        if not self.gen_kl_factor >= 0:
            raise ValueError(f"GritConfig.gen_kl_factor={self.gen_kl_factor} must be >= 0")
        if self.gen_kl_factor > 0 and self.mode == "embedding":
            raise ValueError("GritConfig.gen_kl_factor > 0 needs a generative pass; mode='embedding' has none")
        if self.loss_gen_factor < 0:
            raise ValueError(f"GritConfig.loss_gen_factor={self.loss_gen_factor} must be >= 0")
        if self.gen_sub_batch_size is not None and self.gen_sub_batch_size < 1:
            raise ValueError(f"GritConfig.gen_sub_batch_size={self.gen_sub_batch_size} must be None or >= 1")
        object.__setattr__(self, "data_axes", tuple(self.data_axes))


def group_size(num_queries: int, num_passages: int) -> int:
    """Passages per query G from the batch shapes.

    Raises:
      ValueError: no queries, or a passage count that is not a positive multiple of the query count.
    """
    if num_queries < 1:
        raise ValueError(f"the embedding batch has num_queries={num_queries}; need >= 1")
    if num_passages < num_queries or num_passages % num_queries:
        raise ValueError(f"num_passages={num_passages} must be a positive multiple of num_queries={num_queries} "
                         "(layout [positive, hard negatives...] per query, the same group size for every query)")
    return num_passages // num_queries


def info_nce(q_reps: jax.Array, p_reps: jax.Array, temperature: float = 0.02) -> jax.Array:
    """Global InfoNCE (paper Eq. 1 as the reference computes it).

    Args:
      q_reps: float ``[B, dim]`` query embeddings (unit norm).
      p_reps: float ``[B·G, dim]`` passages, per query ``[positive, hard negatives (G-1)...]``.
      temperature: divisor of the scores.

    Returns:
      float32 scalar: ``mean_i CE(q_i·Pᵀ/τ, target=i·G)``.
    """
    g = group_size(q_reps.shape[0], p_reps.shape[0])
    scores = jnp.einsum("bd,nd->bn", q_reps.astype(jnp.float32), p_reps.astype(jnp.float32)) / temperature
    targets = jnp.arange(q_reps.shape[0]) * g
    return optax.softmax_cross_entropy_with_integer_labels(scores, targets).mean()


def info_nce_local_negatives(q_reps: jax.Array, p_reps: jax.Array, num_shards: int,
                             temperature: float = 0.02) -> jax.Array:
    """InfoNCE without cross-device negatives, computed on the global batch: the batch is split into
    ``num_shards`` contiguous shards (as the data axes shard it) and each shard's queries only see
    that shard's passages; the result is the mean of the shard losses (the DDP average)."""
    b = q_reps.shape[0]
    g = group_size(b, p_reps.shape[0])
    if b % num_shards:
        raise ValueError(f"num_queries={b} must be divisible by the number of data shards {num_shards}")
    q = q_reps.reshape(num_shards, b // num_shards, -1)
    p = p_reps.reshape(num_shards, b // num_shards * g, -1)
    return jax.vmap(functools.partial(info_nce, temperature=temperature))(q, p).mean()


def _gather_keep_local_grad(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """All-gather ``x`` over ``axes`` (tiled on dim 0); only this shard's own slice carries gradient."""
    full = jax.lax.all_gather(jax.lax.stop_gradient(x), axes, axis=0, tiled=True)
    start = jax.lax.axis_index(axes) * x.shape[0]
    return jax.lax.dynamic_update_slice_in_dim(full, x, start, axis=0)


def info_nce_sharded(q_reps: jax.Array, p_reps: jax.Array, *, mesh: Mesh, data_axes: tuple[str, ...],
                     cross_device: bool, temperature: float = 0.02) -> jax.Array:
    """InfoNCE with the batch sharded over ``data_axes`` of ``mesh`` (``shard_map``), as the reference.

    q_reps ``[B, dim]`` / p_reps ``[B·G, dim]`` are global arrays whose leading axis is split over
    ``data_axes``. With ``cross_device`` every shard all-gathers q and p (its own slice keeps the
    gradient), computes the global loss and the shards' gradients sum to ``∇L_global``; otherwise each
    shard uses only its own passages and the loss is the mean of the shard losses.
    Equals ``info_nce`` (cross_device) or ``info_nce_local_negatives`` on the global arrays.
    """
    axes = tuple(a for a in data_axes if a in mesh.axis_names)
    group_size(q_reps.shape[0], p_reps.shape[0])
    num_shards = 1
    for a in axes:
        num_shards *= mesh.shape[a]
    if q_reps.shape[0] % num_shards:
        raise ValueError(f"num_queries={q_reps.shape[0]} must be divisible by the {num_shards} data shards "
                         f"of mesh axes {axes}")
    if not axes:
        return info_nce(q_reps, p_reps, temperature)

    def local(q, p):
        if not cross_device:
            return jax.lax.pmean(info_nce(q, p, temperature), axes)
        loss = info_nce(_gather_keep_local_grad(q, axes), _gather_keep_local_grad(p, axes), temperature)
        # Every shard holds the same loss value; pmean would scale each shard's gradient by 1/W (the
        # reference's DDP average). Scaling the gradient path by W keeps the value and yields the exact
        # gradient of the global loss.
        loss = jax.lax.stop_gradient(loss) + num_shards * (loss - jax.lax.stop_gradient(loss))
        return jax.lax.pmean(loss, axes)

    spec = P(axes)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=P())(q_reps, p_reps)


def next_token_loss(logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array, *, reduction: str = "mixed",
                    sub_batch_size: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Next-token cross-entropy on target tokens (paper Eq. 2, reference ``NextTokenLoss``).

    Args:
      logits: float ``[B, L, vocab]``; position t predicts token t+1.
      tokens: int ``[B, L]``.
      loss_mask: ``[B, L]``, 1 where token t is a target (response tokens and their ``</s>``).
      reduction: ``"mixed"``: token-mean within each sub-batch of ``sub_batch_size`` consecutive samples,
        then the mean over sub-batches that have targets; ``"token"``: sum over target tokens / B.
      sub_batch_size: must divide B; ``None`` = B (one group).

    Returns:
      ``(loss float32 scalar, token accuracy float32 scalar over targets)``.

    Raises:
      ValueError: unknown reduction, shape mismatch, or a sub-batch size that does not divide B.
    """
    if reduction not in GEN_REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}; valid: {GEN_REDUCTIONS}")
    b, length = tokens.shape
    if logits.shape[:2] != (b, length) or loss_mask.shape != (b, length):
        raise ValueError(f"logits {tuple(logits.shape)}, tokens {tuple(tokens.shape)} and loss_mask "
                         f"{tuple(loss_mask.shape)} must agree on [batch, seq]")
    sub = b if sub_batch_size is None else sub_batch_size
    if b % sub:
        raise ValueError(f"gen_sub_batch_size={sub} must divide the generative batch size {b}")
    nll, hits, n = next_token_nll(logits, tokens, loss_mask[:, 1:])
    accuracy = hits.sum() / jnp.maximum(n.sum(), 1.0)
    if reduction == "token":
        return nll.sum() / b, accuracy
    group_sum = nll.reshape(b // sub, -1).sum(axis=1)
    group_n = n.reshape(b // sub, -1).sum(axis=1)
    has = group_n > 0
    group_mean = jnp.where(has, group_sum / jnp.maximum(group_n, 1.0), 0.0)
    return group_mean.sum() / jnp.maximum(has.sum(), 1), accuracy


EMBEDDING_KEYS = ("query_tokens", "query_attention_mask", "query_pool_mask",
                  "passage_tokens", "passage_attention_mask", "passage_pool_mask")
GENERATIVE_KEYS = ("gen_tokens", "gen_attention_mask", "gen_loss_mask")


def check_batch(config: GritConfig, batch: dict) -> None:
    """Validate the batch keys and shapes for ``config.mode`` (shapes are static, so this runs at trace time).

    Raises:
      ValueError: a missing key, mismatched shapes, or a passage count that is not ``G ×`` the query count.
    """
    need = ((EMBEDDING_KEYS if config.mode != "generative" else ()) +
            (GENERATIVE_KEYS if config.mode != "embedding" else ()))
    missing = [k for k in need if k not in batch]
    if missing:
        raise ValueError(f"GRIT mode={config.mode!r} batch is missing keys {missing}; it has {sorted(batch)}")
    for prefix in ("query", "passage", "gen"):
        keys = [k for k in need if k.startswith(prefix + "_")]
        shapes = {k: tuple(batch[k].shape) for k in keys}
        if len(set(shapes.values())) > 1:
            raise ValueError(f"{prefix} arrays must share one [batch, seq] shape; got {shapes}")
    if config.gen_kl_factor > 0:
        if "gen_teacher_hidden" not in batch:
            raise ValueError("GritConfig.gen_kl_factor > 0 needs gen_teacher_hidden [rows, seq, hidden] in the batch "
                             f"(the teacher's hidden states after its final norm); it has {sorted(batch)}")
        if tuple(batch["gen_teacher_hidden"].shape[:2]) != tuple(batch["gen_tokens"].shape):
            raise ValueError(f"gen_teacher_hidden shape {tuple(batch['gen_teacher_hidden'].shape)} must be "
                             f"[rows, seq, hidden] with [rows, seq] = {tuple(batch['gen_tokens'].shape)}")
    if config.mode != "generative":
        group_size(batch["query_tokens"].shape[0], batch["passage_tokens"].shape[0])


@dataclasses.dataclass(frozen=True)
class GritLoss:
    """The GRIT ``loss_fn(model, batch, rng) -> (loss, metrics)`` for the train step (interfaces.md);
    hashable, so it can be the step's static argument (``train.objective=rag_jax.train.objectives.grit:GritLoss``).

    Batch (right-padded int32 arrays, leading global batch axis; see ``rag_jax.data.grit``):
      ``query_tokens/query_attention_mask/query_pool_mask`` ``[B, Lq]``,
      ``passage_tokens/passage_attention_mask/passage_pool_mask`` ``[B·G, Lp]``,
      ``gen_tokens/gen_attention_mask/gen_loss_mask`` ``[Bg, Lg]``; optionally ``query_inputs_embeds``,
      ``passage_inputs_embeds``, ``gen_inputs_embeds`` float ``[rows, L, hidden]``: the first-layer inputs
      instead of the token embeddings (a frozen bottom's output, ``rag_jax.train.frozen_bottom``);
      ``gen_teacher_hidden`` float ``[Bg, Lg, hidden]`` (with ``gen_kl_factor``): a frozen teacher's hidden states
      after its final norm; the teacher's logits are this model's output head applied to them, so the head must
      be frozen (a tied embedding that is not trained, as in ``frozen_bottom.TOP_TRAINABLE``).
    With ``mesh`` the contrastive loss runs under ``shard_map`` over ``config.data_axes`` (cross-device
    negatives or shard-local ones per ``negatives_cross_device``); without a mesh it is computed on the
    global batch, where every negative is visible (``negatives_cross_device=False`` then needs a mesh).
    The contrastive loss does not decompose over micro-batches: use ``grad_accum_steps=1`` (the
    reference uses GradCache for accumulation, notes §5).

    Metrics: ``loss``, ``loss_rep``, ``loss_gen``, ``loss_kl`` (unweighted), ``rep_accuracy`` (positive ranked
    first), ``gen_accuracy`` (next-token accuracy on targets).

    Raises:
      ValueError: ``negatives_cross_device=False`` without a mesh; at trace time, a bad batch (``check_batch``).
    """

    config: GritConfig = GritConfig()
    mesh: Mesh | None = None

    def __post_init__(self):
        if self.mesh is None and self.config.mode != "generative" and not self.config.negatives_cross_device:
            raise ValueError("negatives_cross_device=False needs the mesh (to know the data shards); pass mesh=")

    def __call__(self, model, batch, rng=None):
        del rng  # deterministic: no dropout in GRIT (notes §5)
        config, mesh = self.config, self.mesh
        check_batch(config, batch)
        metrics, loss = {}, jnp.float32(0.0)
        if config.mode != "generative":
            q, p = (encode(model, batch[f"{side}_tokens"], batch[f"{side}_attention_mask"], batch[f"{side}_pool_mask"],
                           inputs_embeds=batch.get(f"{side}_inputs_embeds"))[0] for side in ("query", "passage"))
            if mesh is None:
                loss_rep = info_nce(q, p, config.temperature)
            else:
                loss_rep = info_nce_sharded(q, p, mesh=mesh, data_axes=config.data_axes,
                                            cross_device=config.negatives_cross_device,
                                            temperature=config.temperature)
            g = p.shape[0] // q.shape[0]
            metrics["loss_rep"] = loss_rep
            metrics["rep_accuracy"] = jnp.mean(jnp.argmax(q @ p.T, -1) == jnp.arange(q.shape[0]) * g)
            loss = loss + loss_rep
        if config.mode != "embedding":
            tokens, attn = batch["gen_tokens"], batch["gen_attention_mask"].astype(jnp.int32)
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
            hidden = model(tokens, positions, attn, mode="causal", inputs_embeds=batch.get("gen_inputs_embeds")).hidden
            loss_mask = batch["gen_loss_mask"] * attn
            windowed = config.gen_window is not None and config.gen_window < tokens.shape[1]
            if windowed and config.gen_kl_factor == 0:  # L_KL needs every position
                w = config.gen_window
                idx = jnp.clip(attn.sum(axis=1) - w, 0, tokens.shape[1] - w)[:, None] + jnp.arange(w)
                hidden = jnp.take_along_axis(hidden, idx[:, :, None], axis=1)
                tokens, loss_mask = (jnp.take_along_axis(x, idx, axis=1) for x in (tokens, loss_mask))
            logits = model.logits(hidden)
            if config.gen_kl_factor > 0:
                teacher = model.logits(batch["gen_teacher_hidden"].astype(hidden.dtype))
                metrics["loss_kl"] = distill_kl(logits, teacher, attn)
                loss = loss + config.gen_kl_factor * metrics["loss_kl"]
            loss_gen, acc = next_token_loss(logits, tokens, loss_mask, reduction=config.loss_gen_type,
                                            sub_batch_size=config.gen_sub_batch_size)
            metrics["loss_gen"] = loss_gen
            metrics["gen_accuracy"] = acc
            loss = loss + config.loss_gen_factor * loss_gen
        metrics["loss"] = loss
        return loss, metrics
