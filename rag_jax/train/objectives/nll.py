"""The one next-token cross-entropy (from logits, or fused with the vocab head) and the one distillation KL, shared by every objective (LM, Block-Attention,
GRIT's generative loss, Block-Attention distillation)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rag_jax import sharding
from rag_jax.model import cpu_kernel


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


LOSS_CHUNK = 1024  # tokens whose logits fused_next_token_nll holds at once
STACKED_CHUNKS = 8  # chunks whose head gradients the fused loss holds before summing them


def fused_next_token_nll(hidden: jax.Array, head: jax.Array, tokens: jax.Array, target_weights: jax.Array,
                         *, chunk: int = LOSS_CHUNK) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The vocab head and next-token cross-entropy fused: ``(nll_total, correct_sum [batch], weight_sum [batch])``
    with ``nll_total = sum(next_token_nll(hidden @ head, ...)[0])`` (a float32 scalar), never holding
    ``[batch, seq, vocab]`` logits and without recomputing them for the backward.

    Differentiated, each chunk of about ``chunk`` tokens computes its logits, log-sum-exp and softmax once and
    turns them at once into its share of the gradients (``dlogits = w * (softmax - onehot)``,
    ``d_hidden = dlogits @ headᵀ``, ``d_head += hiddenᵀ @ dlogits``); the backward only scales them by the
    incoming cotangent (the loss is a scalar, so that is exact). Same matmul FLOPs as autodiff of the full
    logits, O(chunk x vocab + hidden x vocab) memory. Undifferentiated, only the loss is computed. Gradients
    flow through ``nll_total`` (to ``hidden``, ``head`` and ``target_weights``); ``correct_sum`` and
    ``weight_sum`` are metrics.

    Args:
      hidden: ``[batch, seq, hidden]`` final hidden states (after the final norm).
      head: ``[hidden, vocab]`` output projection (``Transformer.head_weight()``), cast to ``hidden.dtype`` with
        float32 accumulation as ``Transformer.logits``.
      tokens, target_weights: as :func:`next_token_nll`.
      chunk: tokens per chunk: ``chunk // batch`` positions (at least one) of every row, so the batch axis and
        its sharding stay as they are.

    Same-run A/B (issue 28; 4-layer SmolLM2-shaped model, vocab 49,152, 4 x 256 tokens, AdamW step, one pinned
    core, CPU time, 5 alternating rounds): 3,632 vs 3,844 ms per step (1.06x) against the full logits;
    rematerializing each chunk's logits in the backward instead (``jax.checkpoint`` per chunk) was 0.91x.
    """
    return _fused_nll(hidden, head, tokens, target_weights.astype(jnp.float32), chunk)


def _chunked(hidden, tokens, w, chunk):
    b, s, _ = hidden.shape
    n = s - 1
    cs = max(1, min(n, chunk // b))
    pad = -n % cs

    def chunks(x):  # [b, n, ...] -> [n_chunks, b, cs, ...]
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, (n + pad) // cs, cs, *x.shape[2:]), 1, 0)

    def unchunk(x):  # [n_chunks, b, cs, ...] -> [b, n, ...]
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape(b, -1, *x.shape[3:])[:, :n]
    return chunks(hidden[:, :-1]), chunks(tokens[:, 1:]), chunks(w), unchunk


def _chunk_logits(x, head):
    return sharding.constrain(jnp.einsum("bsh,hv->bsv", x, head.astype(x.dtype), preferred_element_type=jnp.float32),
                              ("batch", "seq", "vocab"))


def _xent_stats(logits, t):
    """``(lse, target logit, row max)`` ``[..]`` of float32 ``logits [.., vocab]``. One row max serves the
    log-sum-exp and the hits (the target's logit reaching it; an exact tie counts as a hit) instead of a separate
    argmax pass over the vocab (issue 28: the argmax reduce alone was ~4% of a SmolLM2-width train step on CPU)."""
    top = jax.lax.stop_gradient(logits.max(-1))
    lse = top + jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1))
    return lse, jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0], top


def _xent_grad_xla(logits, t, wt):
    lse, target, top = _xent_stats(logits, t)
    dlogits = (jnp.exp(logits - lse[..., None]) - jax.nn.one_hot(t, logits.shape[-1], dtype=jnp.float32)) * wt[..., None]
    return dlogits, lse, target, top


def _xent_grad_cpu(logits, t, wt):
    rows = logits.shape[:-1]
    dlogits, *stats = cpu_kernel.softmax_xent(logits.reshape(-1, logits.shape[-1]), t.reshape(-1), wt.reshape(-1))
    return dlogits.reshape(logits.shape), *(x.reshape(rows) for x in stats)


def _xent_grad(logits, t, wt):
    """``(dlogits = wt * (softmax - onehot), lse, target logit, row max)`` of float32 ``logits [b, s, vocab]``: on
    the CPU backend the one-pass C++ kernel (``cpu_kernel.softmax_xent``: the logits read once, the gradient
    written once; XLA's fusions make four passes over the ``chunk x vocab`` block), else XLA."""
    if not (jax.default_backend() == "cpu" and cpu_kernel.available()):
        return _xent_grad_xla(logits, t, wt)
    return jax.lax.platform_dependent(logits, t, wt, cpu=_xent_grad_cpu, default=_xent_grad_xla)


def _fused_forward(hidden, head, tokens, w, chunk, with_grads: bool):
    xs, ts, ws, unchunk = _chunked(hidden, tokens, w, chunk)

    def step(_, args):
        x, t, wt = args
        logits = _chunk_logits(x, head)
        dx = d_head = None
        if with_grads:
            dlogits, lse, target, top = _xent_grad(logits, t, wt)
            dlogits = dlogits.astype(x.dtype)
            dx = jnp.einsum("bsv,hv->bsh", dlogits, head.astype(x.dtype),
                            preferred_element_type=jnp.float32).astype(hidden.dtype)
            d_head = jnp.einsum("bsh,bsv->hv", x, dlogits, preferred_element_type=jnp.float32)
        else:
            lse, target, top = _xent_stats(logits, t)
        return None, (lse - target, (target >= top).astype(jnp.float32), dx, d_head)

    if not with_grads:
        _, (nll, hits, _, _) = jax.lax.scan(step, None, (xs, ts, ws))
    else:
        # chunks' d_head come out of an inner scan of up to STACKED_CHUNKS chunks and are summed after it: added
        # inside the loop, XLA:CPU fuses the add into the dot, which then ran at 145 vs 250 GFLOP/s (issue 28:
        # the head's gradient 4.0 vs 4.3 s per step at 4 x 1,024 tokens); memory STACKED_CHUNKS x |head|
        n = xs.shape[0]
        inner = max(i for i in range(1, min(n, STACKED_CHUNKS) + 1) if n % i == 0)

        def group(d_head, args):
            _, (nll, hits, dx, d) = jax.lax.scan(step, None, args)
            return d_head + d.sum(0), (nll, hits, dx)

        grouped = jax.tree.map(lambda a: a.reshape(n // inner, inner, *a.shape[1:]), (xs, ts, ws))
        d_head, (nll, hits, dx) = jax.lax.scan(group, jnp.zeros(head.shape, jnp.float32), grouped)
        nll, hits, dx = jax.tree.map(lambda a: a.reshape(n, *a.shape[2:]), (nll, hits, dx))
    nll, hits = unchunk(nll), unchunk(hits)
    out = (jnp.sum(nll * w), jnp.sum(hits * w, axis=-1), jnp.sum(w, axis=-1))
    if not with_grads:
        return out, None
    dx = jnp.pad(unchunk(dx), ((0, 0), (0, 1), (0, 0)))  # the last position predicts nothing
    return out, (dx, d_head.astype(head.dtype), nll)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused_nll(hidden, head, tokens, w, chunk):
    return _fused_forward(hidden, head, tokens, w, chunk, with_grads=False)[0]


def _fused_nll_fwd(hidden, head, tokens, w, chunk):
    out, res = _fused_forward(hidden, head, tokens, w, chunk, with_grads=True)
    return out, (*res, tokens)


def _fused_nll_bwd(chunk, res, cotangents):
    dx, d_head, nll, tokens = res
    g = cotangents[0]  # only nll_total is differentiable
    return ((g * dx).astype(dx.dtype), (g * d_head).astype(d_head.dtype),
            np.zeros(tokens.shape, jax.dtypes.float0), g * nll)


_fused_nll.defvjp(_fused_nll_fwd, _fused_nll_bwd)


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
