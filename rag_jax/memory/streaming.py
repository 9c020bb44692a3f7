"""Streaming chunked prefill and decode with episodic memory (EM-LLM, Fountas et al., ICLR 2025, §3; InfLLM).

Over 500 lines on purpose: ``EMLLM`` is one stateful object (local window, initial tokens, event store, per-layer
retrieval) whose prefill and decode share that state; segmentation, refinement, the store and the index are
already their own modules in ``rag_jax.memory``.

``EMLLM`` wraps any rag_jax ``Transformer`` at inference (training-free) and processes inputs far longer than its
trained context, batch 1 (as the reference). Every chunk of ``chunk_size`` tokens runs the model layer by layer
(the core's layer internals), where each layer attends with ONE joint softmax (``attend_joint``) over

- the **local window**: the previous ``n_local`` tokens and the chunk, keys rotated at their true relative
  positions (causal sliding window);
- **memory**: the ``n_init`` initial tokens (attention sinks), the events retrieved for this layer
  (similarity + contiguity, ``event_retrieval``) in temporal order, and the buffered tokens that left the query's
  window but are not yet formed into events.

Positions (``EMLLMConfig.positions``): ``"inf_llm"`` (default, reference behaviour) leaves memory keys unrotated
and rotates the memory query to ``n_local - 1``, so every memory token sits just outside the window (note §4.4);
``"contiguous"`` re-encodes memory at contiguous positions ``0..G-1`` (init, then events in temporal order) and
the buffer after them, so a memory holding everything reproduces full attention exactly.

After each chunk the model's surprise ``-log p(x[t+1] | x[<=t])`` sets event boundaries (``segmentation``),
optionally refined on the key-similarity graph (``refinement``), and tokens that left the window become events
(``event_store``): KV to host, one representative vector per layer into the layer's index.

Per chunk the host makes one dispatch per layer (``_step``: this layer's attention and MLP, then the next layer's
q/k/v and retrieval query) and one round trip per layer (the retrieval query
comes back, the host ranks events and loads the missing ones in one transfer), then the head, and one dispatch
for the memory cut (``_cut``: init tokens, representative vectors, event KV to the host in one transfer, buffer shift). The
retrieval of layer ``l + 1`` needs layer ``l``'s output, so layers cannot share a jit without moving the event
index to the device (device memory would then grow with the stream).

Deliberate differences from the reference code (note §4.4, §4.6):
- the memory stage masks buffered tokens still inside a query's window (the reference's complement mask is a
  no-op, so in chunked prefill it attends up to ``chunk_size - 1`` window tokens twice); here every key is seen
  exactly once per query;
- RoPE uses the model's own inverse frequencies (incl. Llama-3.1 scaling, which the reference ignores);
- surprise statistics are float64 and representative scores float32.

Over 500 lines on purpose: one chunk's step (local window + memory plan + joint attention, then segmentation and
the event store update) is a single stateful loop whose parts share the per-layer buffers and the compiled step;
the pieces with a job of their own already live beside it (``segmentation``, ``refinement``, ``event_store``,
``event_retrieval``, ``index``).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rag_jax.inference.kv_store import WeightsWatch
from rag_jax.inference.magicpig import MagicPIGDecode, TopKDecode, decode_logits
from rag_jax.memory.config import EMLLMConfig
from rag_jax.memory.event_retrieval import ContiguityBuffer, merge_temporal, retrieval_budget, select_by_similarity
from rag_jax.memory.event_store import DeviceEventCache, EventStore, representative_vectors
from rag_jax.memory.refinement import key_similarity
from rag_jax.memory.segmentation import EventSegmenter, surprise_from_logits
from rag_jax.model import MaskSpec, Transformer, apply_rope, attend_joint, key_mass
from rag_jax.model.blockwise import MASK_VALUE
from rag_jax.tokenizer import eos_tuple


@flax.struct.dataclass
class LayerBuffers:
    """Fixed-size device state of one layer.

    Attributes:
      recent_k, recent_v: ``[buffer_len, num_kv_heads, head_dim]`` pre-RoPE KV of the tokens not yet in
        events or init (the local window plus older tokens awaiting event formation), in stream order.
      recent_score: float32 ``[num_heads, buffer_len]`` attention mass each buffered token received while in
        the local window (representative-token scores).
      init_k, init_v: ``[max(n_init, 1), num_kv_heads, head_dim]`` initial tokens.
    """

    recent_k: jax.Array
    recent_v: jax.Array
    recent_score: jax.Array
    init_k: jax.Array
    init_v: jax.Array


@flax.struct.dataclass
class MemoryPlan:
    """One layer's retrieved memory for one chunk, built on the host by ``EMLLM._plan_memory``.

    Attributes:
      slot, offset: int32 ``[memory_capacity]``: device-cache slot and offset in it of each retrieved token.
      valid: bool ``[memory_capacity]``: the token exists (the rest is padding).
      position: int32 ``[memory_capacity]``: contiguous position of the token (``positions="contiguous"``).
      base: int32 scalar: init + retrieved tokens (contiguous positions of the buffer start after them).
    """

    slot: np.ndarray
    offset: np.ndarray
    valid: np.ndarray
    position: np.ndarray
    base: np.ndarray


@flax.struct.dataclass
class StepParams:
    """Pre-flattened parameters: passing flat leaves to a jit skips NNX's per-call pytree walk and graph hashing
    (~0.7 ms a call, 31 calls per chunk). ``model``: every leaf of the model (embedding, final norm, head);
    ``layers[i]``: the leaves of decoder layer ``i``."""

    model: list
    layers: list


def _merge(definition, leaves):
    """A module from ``definition = (graphdef, treedef)`` and its flat parameter ``leaves``."""
    graphdef, treedef = definition
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def _project(layer, x, n_valid, n_local: int, inv_freq):
    """Pre-RoPE q/k/v of the chunk and the retrieval query: the mean over valid queries of q rotated to
    ``n_local - 1`` (reference ``_calc_topk_blocks``), float32 ``[num_heads * head_dim]``."""
    q, k, v = layer.qkv(x)
    q_len = q.shape[1]
    q_ret = apply_rope(q, jnp.full((1, q_len), n_local - 1, jnp.int32), inv_freq).astype(jnp.float32)
    ok = (jnp.arange(q_len) < n_valid).astype(jnp.float32)
    q_mean = jnp.einsum("bqhd,q->hd", q_ret, ok) / jnp.maximum(n_valid, 1)
    return q, k, v, q_mean.reshape(-1)


def _attend(layer, n_local: int, positions: str, use_memory: bool, impl: str, diagnose: bool, sampler, measure: bool,
            buf: LayerBuffers, cache_k, cache_v, x, q, k, v, inv_freq, plan: MemoryPlan, start, n_valid, init_len,
            dense_layer):
    """One decoder layer over the chunk with local + memory attention in one softmax (``attend_joint``).

    ``start``: buffer slot of the chunk's first token; ``plan``: the layer's retrieved event tokens.
    Groups: the local window (buffer slots, causal within ``n_local``), then memory (init tokens and
    retrieved events, seen by every valid query, and the buffer slots a query reaches only outside its window:
    ``slot + n_local <= query slot``). With a ``sampler`` (``EMLLM``'s ``decode_attention``) a decode step
    (one query) estimates the retrieved events and the buffer outside the window by it (``_sampled_joint``)
    unless ``dense_layer``; init tokens and the window stay exact; with ``measure`` exact attention is computed
    beside it (the layer continues with the estimate) for the error. Returns the layer output, the updated buffers
    (the local keys' attention mass summed over the valid queries added to ``recent_score``, note §4.2), with
    ``diagnose`` the last valid query's weights float32 ``[num_heads, sum(kv_len_i)]`` (else None), and float32
    ``[3]``: the estimate's relative L2 error against exact attention (mean over heads; 0 unless ``measure``),
    the fraction of the estimated keys it used (1 where nothing is estimated) and their number.
    """
    q_len, buf_len = q.shape[1], buf.recent_k.shape[0]
    recent_k = jax.lax.dynamic_update_slice(buf.recent_k, k[0].astype(buf.recent_k.dtype), (start, 0, 0))
    recent_v = jax.lax.dynamic_update_slice(buf.recent_v, v[0].astype(buf.recent_v.dtype), (start, 0, 0))

    slots = jnp.arange(buf_len)
    q_slots = start + jnp.arange(q_len)
    q_ok = jnp.arange(q_len) < n_valid
    q_seg, slot_ok = q_ok.astype(jnp.int32)[None], slots < start + n_valid
    local_mask = MaskSpec.create("causal", q_seg, slot_ok.astype(jnp.int32)[None], q_order=q_slots, kv_order=slots,
                                 q_positions=q_slots[None], kv_positions=slots[None], sliding_window=n_local)

    base = plan.base if positions == "contiguous" else 0
    q_local = apply_rope(q, (base + q_slots)[None], inv_freq)
    k_local = apply_rope(recent_k[None], (base + slots)[None], inv_freq)
    groups = [(q_local, k_local, recent_v[None], local_mask)]

    if use_memory:
        # Buffered tokens a query can reach only outside its window lie in the first buf_len - n_local slots.
        n_out = buf_len - n_local
        n_init = buf.init_k.shape[0]
        mem_k = jnp.concatenate([buf.init_k, cache_k[plan.slot, plan.offset], recent_k[:n_out]])
        mem_v = jnp.concatenate([buf.init_v, cache_v[plan.slot, plan.offset], recent_v[:n_out]])
        mem_ok = jnp.concatenate([jnp.arange(n_init) < init_len, plan.valid, slot_ok[:n_out]])
        mem_order = jnp.concatenate([jnp.zeros(n_init + plan.valid.shape[0], jnp.int32), slots[:n_out] + n_local])
        mem_mask = MaskSpec.create("causal", q_seg, mem_ok.astype(jnp.int32)[None], q_order=q_slots,
                                   kv_order=mem_order)
        if positions == "contiguous":
            mem_positions = jnp.concatenate([jnp.arange(n_init), plan.position, plan.base + slots[:n_out]])
            q_mem = q_local
            mem_k = apply_rope(mem_k[None], mem_positions[None].astype(jnp.int32), inv_freq)[0]
        else:
            q_mem = apply_rope(q, jnp.full((1, q_len), n_local - 1, jnp.int32), inv_freq)
        groups.append((q_mem, mem_k[None], mem_v[None], mem_mask))

    estimate = jnp.asarray([0.0, 1.0, 0.0], jnp.float32)
    if use_memory and sampler is not None and q_len == 1:
        middle = jnp.concatenate([jnp.zeros(n_init, bool), plan.valid, slot_ok[:n_out]])[None]
        out, lse, used, count = _sampled_joint(sampler, dense_layer, groups, middle)
        error = 0.0
        if measure:
            exact = attend_joint(groups, impl=impl).astype(jnp.float32)
            error = jnp.mean(jnp.linalg.norm(out.astype(jnp.float32) - exact, axis=-1)
                             / jnp.maximum(jnp.linalg.norm(exact, axis=-1), 1e-30))
        estimate = jnp.stack([jnp.asarray(error, jnp.float32), used, count.astype(jnp.float32)])
    else:
        out, lse = attend_joint(groups, return_lse=True, impl=impl)
    mass = key_mass(q_local, k_local, local_mask, lse, q_ok.astype(jnp.float32)[None, None])[0, 0]
    last_weights = None
    if diagnose:
        last = (jnp.arange(q_len) == n_valid - 1).astype(jnp.float32)[None, None]
        last_weights = jnp.concatenate([key_mass(gq, gk, m, lse, last)[0, 0] for gq, gk, _, m in groups], -1)
    x = layer.finish(x, out)
    return (x, buf.replace(recent_k=recent_k, recent_v=recent_v, recent_score=buf.recent_score + mass), last_weights,
            estimate)


def _sampled_joint(sampler, dense_layer, groups, middle):
    """``attend_joint`` of a decode step's ``[(window), (memory)]`` groups with the memory's ``middle`` slots
    (bool ``[1, mem_len]``) estimated by ``sampler`` (``inference.magicpig.decode_logits``; exact where
    ``dense_layer``): ``(out [1, 1, num_heads, head_dim], lse [1, num_kv_heads, heads_per_kv_head, 1], the
    fraction of middle keys kept, averaged over heads, the number of middle keys)``."""
    logits, values = [], []
    for i, (q, k, v, mask) in enumerate(groups):
        kt, allowed = jnp.swapaxes(k, 1, 2), mask.dense()
        if i == 0:
            logits.append(decode_logits(None, q, kt, allowed, jnp.zeros(allowed.shape[::2], bool)))
        else:
            middle = middle & allowed[:, 0]           # memory slots this query attends (not those in its window)
            logits.append(jnp.where(dense_layer, decode_logits(None, q, kt, allowed, middle),
                                    decode_logits(sampler, q, kt, allowed, middle)))
        values.append(jnp.swapaxes(v, 1, 2))
    kept = jnp.sum(middle[:, None, None, :] & (logits[1] > MASK_VALUE / 2), -1)
    count = jnp.sum(middle)
    used = jnp.sum(kept) / (kept.size * jnp.maximum(count, 1))    # one division: exactly 1 when all are kept
    joint = jnp.concatenate(logits, -1)                                       # [1, kvh, g, keys]
    lse = jax.nn.logsumexp(joint, axis=-1)
    w = jnp.exp(joint - lse[..., None])
    out = jnp.einsum("bhgk,bhkd->bhgd", w, jnp.concatenate(values, 2).astype(jnp.float32))
    q = groups[0][0]
    return out.reshape(1, 1, q.shape[2], q.shape[3]).astype(q.dtype), lse[..., None], used, count


def _start(model_def, layer_def, n_local, model_leaves, layer_leaves, tokens, n_valid, inv_freq):
    """Embed the chunk (int32 ``[1, q_len]``) and project it for layer 0: ``(x, q, k, v, q_mean)``."""
    x = _merge(model_def, model_leaves).embed(tokens)
    return (x, *_project(_merge(layer_def, layer_leaves), x, n_valid, n_local, inv_freq))


def _step(layer_def, n_local, positions, use_memory, impl, diagnose, sampler, measure, layer_leaves, next_leaves, buf,
          cache_k, cache_v, x, q, k, v, inv_freq, plan, start, n_valid, init_len, dense_layer):
    """``_attend`` for one layer, then under the same jit the next layer's projection (``next_leaves``; the last
    layer projects with any layer's leaves and the result is dropped: one compiled shape for every layer):
    ``(buf, last_weights, estimate, (x, q, k, v, q_mean))``. One dispatch and one host round trip (the retrieval
    query) per layer."""
    x, buf, last_weights, estimate = _attend(_merge(layer_def, layer_leaves), n_local, positions, use_memory, impl,
                                             diagnose, sampler, measure, buf, cache_k, cache_v, x, q, k, v, inv_freq,
                                             plan, start, n_valid, init_len, dense_layer)
    return buf, last_weights, estimate, (x, *_project(_merge(layer_def, next_leaves), x, n_valid, n_local, inv_freq))


def _head(model_def, model_leaves, x, labels):
    """Logits ``[q_len, vocab]`` of the last layer's output and, with ``labels`` (int32 ``[1, q_len]``, the next
    tokens), the surprise ``-log p(label)`` ``[q_len]`` (else None)."""
    model = _merge(model_def, model_leaves)
    logits = model.logits(model.final_norm(x))
    return logits[0], None if labels is None else surprise_from_logits(logits, labels)[0]


@functools.lru_cache(maxsize=16)
def _compiled(model_def, layer_def, n_local: int, positions: str, use_memory: bool, impl: str, diagnose: bool,
              sampler=None, measure: bool = False):
    """The chunk's jitted functions for one model structure and config; static arguments are bound (hashed) once
    here instead of on every call."""
    start = jax.jit(functools.partial(_start, model_def, layer_def, n_local))
    step = jax.jit(functools.partial(_step, layer_def, n_local, positions, use_memory, impl, diagnose, sampler,
                                     measure),
                   donate_argnums=(2,))
    head = jax.jit(functools.partial(_head, model_def))
    return start, step, head


@functools.partial(jax.jit, static_argnums=(2,))
def _chunk_similarity(keys, start, width):
    """Similarity graph ``[width, width]`` of buffer slots ``start..start+width-1`` (clipped) from
    ``keys [layers, buffer_len, kv_heads, head_dim]``."""
    idx = jnp.clip(start + jnp.arange(width), 0, keys.shape[1] - 1)
    return key_similarity(keys[:, idx])


def _take_init(b: LayerBuffers, init_len, count) -> LayerBuffers:
    """Copy buffer slots ``0..count-1`` into init slots ``init_len..init_len+count-1``."""
    slot = jnp.arange(b.init_k.shape[0])
    src = jnp.clip(slot - init_len, 0, b.recent_k.shape[0] - 1)
    take = (slot >= init_len) & (slot < init_len + count)
    pick = lambda init, recent: jnp.where(take[:, None, None], recent[src], init)  # noqa: E731
    return b.replace(init_k=pick(b.init_k, b.recent_k), init_v=pick(b.init_v, b.recent_v))


def _drop_front(b: LayerBuffers, count, new_len) -> LayerBuffers:
    """Remove the first ``count`` buffer slots (shift left) and clear scores beyond ``new_len``."""
    keep = jnp.arange(b.recent_k.shape[0]) < new_len
    score = jnp.where(keep[None], jnp.roll(b.recent_score, -count, axis=1), 0.0)
    return b.replace(recent_k=jnp.roll(b.recent_k, -count, axis=0), recent_v=jnp.roll(b.recent_v, -count, axis=0),
                     recent_score=score)


@functools.partial(jax.jit, donate_argnums=(0,))
def _clear_scores(bufs, fill):
    """Zero every layer's ``recent_score`` from buffer slot ``fill`` on (the slots of rejected verified tokens)."""
    return [b.replace(recent_score=jnp.where(jnp.arange(b.recent_score.shape[1]) < fill, b.recent_score, 0.0))
            for b in bufs]


@functools.partial(jax.jit, static_argnums=(8, 9, 10), donate_argnums=(0,))
def _cut(bufs, init_len, init_count, first_slot, starts, sizes, count, new_len, repr_topk, max_block_size, span):
    """Apply a ``Cut`` to every layer's buffers in one dispatch.

    Buffer slots ``0..init_count-1`` go to init slots from ``init_len``; events are the slots from ``first_slot``
    with ``sizes`` (event ``i`` at ``starts[i]``; padding events have size 0); then the first ``count`` slots are
    dropped and scores past ``new_len`` (the buffer fill after the cut) cleared. Returns ``(bufs, vectors, k, v)``: representative vectors float32 ``[max_events, num_layers,
    num_heads * head_dim]`` and the KV of buffer slots ``first_slot..first_slot+span-1``
    ``[num_layers, span, kv_heads, head_dim]`` (events first; ``span = 0``: no events, empty arrays).
    """
    keys = jnp.stack([b.recent_k for b in bufs])              # [L, C, kvh, d]
    buf_len = keys.shape[1]
    if span:
        scores = jnp.stack([b.recent_score for b in bufs])    # [L, H, C]

        def one(start, size):
            idx = jnp.clip(start + jnp.arange(max_block_size), 0, buf_len - 1)
            return representative_vectors(keys[:, idx], scores[:, :, idx], jnp.maximum(size, 1), repr_topk)

        vectors = jax.vmap(one)(starts, sizes)
        idx = jnp.clip(first_slot + jnp.arange(span), 0, buf_len - 1)
        k, v = keys[:, idx], jnp.stack([b.recent_v for b in bufs])[:, idx]
    else:
        vectors = k = v = jnp.zeros((0,), jnp.float32)
    bufs = [_drop_front(_take_init(b, init_len, init_count), count, new_len) for b in bufs]
    return bufs, vectors, k, v


class EMLLM:
    """EM-LLM streaming inference over a ``Transformer`` (batch 1).

    Usage::

        em = EMLLM(model, EMLLMConfig(n_local=256, n_mem=256, chunk_size=64))
        logits = em.prefill(tokens)            # int [seq] -> float32 [vocab] after the last token
        new_tokens = em.generate(tokens, max_new_tokens=16)
        rows = em.verify(drafted); em.commit(kept)   # speculative decoding: read a round, keep a prefix

    Attributes (inspectable state): ``buffers`` (per-layer ``LayerBuffers``), ``cache`` (``DeviceEventCache``),
    ``store`` (host ``EventStore``), ``segmenter`` (``EventSegmenter``: buffer fill, init length, stream length),
    ``retrieved`` (per layer, the event ids attended by the last chunk, in temporal order) and, with
    ``diagnose=True``, ``attention`` (per layer, ``(key_positions, weights)`` of the last chunk's last query:
    the stream position of every key, -1 for padding, int64 ``[keys]``, and its attention weights float32
    ``[num_heads, keys]``; a key's weights sum over its copies, which the masks make disjoint).

    ``decode_attention`` (``inference.magicpig.MagicPIGDecode`` or ``TopKDecode``, MagicPIG, ICLR 2025): decode
    steps (one token) estimate the retrieved events and the buffer outside the window by LSH sampling or top-k,
    the keys hashed every step (the retrieved memory changes); init tokens (the sinks) and the local window stay
    exact, as do prefill and ``verify`` chunks. ``estimates[layer]`` holds the last decode step's float32 ``[3]``:
    the relative L2 error of the estimated attention output against exact attention at the same inputs (with
    ``measure=True``, which computes both; else 0), the fraction of the estimated keys used (mean over heads) and
    their number.

    The weights are read at construction and ``reset``; a stream fed after the model's weights changed in place
    (``nnx.update``) raises ValueError (its memory holds the old weights' KV), an empty stream takes the new ones.

    Raises ValueError for bad configs (see ``EMLLMConfig``), ``refine_from_layer >= num_layers``, a
    ``decode_attention`` that is not a MagicPIG / TopK policy or is given with the memory off, empty input,
    batched input, token ids outside the vocabulary (TypeError for non-integer tokens) or changed weights.
    """

    def __init__(self, model: Transformer, cfg: EMLLMConfig, *, index_factory=None, diagnose: bool = False,
                 decode_attention=None, measure: bool = False):
        mcfg = model.config
        if cfg.refinement is not None and cfg.refine_from_layer >= mcfg.num_layers:
            raise ValueError(f"refine_from_layer={cfg.refine_from_layer} must be < num_layers={mcfg.num_layers}")

        if decode_attention is not None and not isinstance(decode_attention, (MagicPIGDecode, TopKDecode)):
            raise ValueError(f"decode_attention={decode_attention!r}; valid: None, MagicPIGDecode, TopKDecode")
        if decode_attention is not None and not cfg.memory:
            raise ValueError("decode_attention samples EM-LLM's memory; EMLLMConfig.memory=False has none")
        self.cfg, self.model_config = cfg, mcfg
        graphdef, state = nnx.split(model)
        layer_graphdef, layer_state = nnx.split(model.layer(0))
        self._model = model
        self._weights = WeightsWatch(state)  # live: sees nnx.update of the model
        self._start, self._step, self._head = _compiled((graphdef, jax.tree.structure(state)),
                                            (layer_graphdef, jax.tree.structure(layer_state)), cfg.n_local,
                                            cfg.positions, cfg.memory, mcfg.attention_impl, diagnose,
                                            decode_attention, measure)
        self.decode_attention = decode_attention
        self._inv_freq = model.inv_freq
        self._index_factory = index_factory
        self.buffer_len = cfg.n_local + cfg.chunk_size + cfg.max_block_size
        self.diagnose = diagnose
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget the stream (device buffers are reallocated at the same sizes) and read the model's
        current weights."""
        self._weights.refresh()
        self._params = StepParams(jax.tree.leaves(nnx.state(self._model)),
                                  [jax.tree.leaves(nnx.state(self._model.layer(i))) for i in range(self.model_config.num_layers)])
        self._started = False
        m, cfg = self.model_config, self.cfg
        dt = m.compute_dtype
        kv_shape = (self.buffer_len, m.num_kv_heads, m.head_dim)
        init_shape = (max(cfg.n_init, 1), m.num_kv_heads, m.head_dim)
        self.buffers = [LayerBuffers(jnp.zeros(kv_shape, dt), jnp.zeros(kv_shape, dt),
                                     jnp.zeros((m.num_heads, self.buffer_len), jnp.float32),
                                     jnp.zeros(init_shape, dt), jnp.zeros(init_shape, dt))
                        for _ in range(m.num_layers)]
        self.cache = DeviceEventCache(m.num_layers, cfg.cached_events, cfg.max_block_size, m.num_kv_heads,
                                      m.head_dim, dt)
        self.store = EventStore(m.num_layers, m.num_heads * m.head_dim, cfg, self._index_factory)
        self._contiguity = [ContiguityBuffer() for _ in range(m.num_layers)]
        self.segmenter = EventSegmenter(cfg, self.buffer_len, np.dtype(dt))
        self._verified = 0      # tokens read by ``verify`` and not yet committed
        self.retrieved: list[list[int]] = [[] for _ in range(m.num_layers)]
        self.attention: list[tuple[np.ndarray, np.ndarray] | None] = [None] * m.num_layers
        self.estimates: list = [None] * m.num_layers

    def device_buffers(self) -> dict[str, jax.Array]:
        """Every per-stream device array (their sizes do not depend on the stream length)."""
        out = {}
        for i, b in enumerate(self.buffers):
            for name in ("recent_k", "recent_v", "recent_score", "init_k", "init_v"):
                out[f"layer{i}.{name}"] = getattr(b, name)
            out[f"layer{i}.cache_k"], out[f"layer{i}.cache_v"] = self.cache.k[i], self.cache.v[i]
        return out

    @property
    def device_nbytes(self) -> int:
        return int(sum(x.nbytes for x in self.device_buffers().values()))

    # ------------------------------------------------------------------ public API
    def prefill(self, tokens, return_all_logits: bool = False):
        """Feed ``tokens`` (int ``[seq]``, seq >= 1) into the stream.

        As the reference: tokens ``[:-1]`` go through chunked prefill with surprise from the next token; the last
        token goes through the decode path. Returns float32 logits ``[vocab]`` predicting the next token, or
        ``[seq, vocab]`` for every position with ``return_all_logits`` (tests; memory grows with seq).
        """
        tokens = self._check_tokens(tokens)
        collected = []
        body = tokens[:-1]
        for st in range(0, len(body), self.cfg.chunk_size):
            chunk = body[st:st + self.cfg.chunk_size]
            logits = self._process(chunk, tokens[st + 1:st + 1 + len(chunk)], head=return_all_logits)
            if return_all_logits:
                collected.append(np.asarray(logits)[:len(chunk)])
        last = self.step(int(tokens[-1]))
        if return_all_logits:
            return np.concatenate(collected + [last[None]])
        return last

    def step(self, token: int) -> np.ndarray:
        """Decode one token (no surprise boundary, as the reference's decode path); float32 logits ``[vocab]``."""
        tokens = self._check_tokens([token])
        return np.asarray(self._process(tokens, None, head=True))[0]

    def generate(self, prompt, max_new_tokens: int, eos_id: int | Sequence[int] | None = None) -> list[int]:
        """Greedy generation after ``prompt`` (int ``[seq]``); returns up to ``max_new_tokens`` ids, stopping
        after the first id in ``eos_id`` (an int or a sequence of ints)."""
        eos = eos_tuple(eos_id)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
        logits = self.prefill(prompt)
        out = []
        for i in range(max_new_tokens):
            token = int(np.argmax(logits))
            out.append(token)
            if token in eos or i == max_new_tokens - 1:
                break
            logits = self.step(token)
        return out

    def verify(self, tokens) -> np.ndarray:
        """Read ``tokens`` (int ``[n]``, ``1 <= n <= chunk_size``) on the decode path in one chunk and return the
        float32 logits after each, ``[n, vocab]``, without forming memory yet: ``commit(m)`` keeps the first ``m``
        and drops the rest, so a speculative decoder (``inference.rapid``) verifies a round of drafted tokens in
        one call and rewinds the rejected ones. The chunk is padded to a power of two (at least 8) rather than to
        ``chunk_size``. The kept tokens' keys and values are those of this call: retrieval ran once for the
        chunk (its mean query, as in prefill), with the rejected tokens among its queries; their attention mass
        on the window's keys stays in the representative scores (``commit`` clears only the rejected slots).

        Raises:
          ValueError: a verified chunk not yet committed, more than ``chunk_size`` tokens, or ``step``'s input
            errors.
        """
        tokens = self._check_tokens(tokens)
        if len(tokens) > self.cfg.chunk_size:
            raise ValueError(f"verify reads at most chunk_size={self.cfg.chunk_size} tokens; got {len(tokens)}")
        return np.asarray(self._process(tokens, None, head=True, commit=False))[:len(tokens)]

    def commit(self, n: int) -> None:
        """Keep the first ``n`` tokens of the last ``verify`` (``0 <= n <=`` its length) and form memory as
        ``step`` would after them; the stream then continues as if the rest had never been read.

        Raises:
          ValueError: no verified chunk, or ``n`` outside ``[0, verified]``.
        """
        if not self._verified:
            raise ValueError("commit() needs a verify() call before it")
        if not 0 <= n <= self._verified:
            raise ValueError(f"commit n={n} must be in [0, {self._verified}] (the tokens verify read)")
        if n < self._verified:
            self.buffers = _clear_scores(self.buffers, np.int32(self.segmenter.fill + n))
        self._verified = 0
        if n:
            self._update_memory(n, None)

    def _check_tokens(self, tokens) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens must be a 1-D sequence (batch size 1, as the reference); got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError("tokens is empty; EM-LLM needs at least one token")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"tokens must be integers; got dtype {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.model_config.vocab_size:
            raise ValueError(f"token id {hi if hi >= self.model_config.vocab_size else lo} is outside the vocabulary "
                             f"[0, vocab_size={self.model_config.vocab_size})")
        return arr.astype(np.int32)

    # ------------------------------------------------------------------ one chunk
    def _process(self, tokens: np.ndarray, labels: np.ndarray | None, head: bool, commit: bool = True):
        """Run one chunk (``len(tokens) <= chunk_size``) through all layers, then update memory (with ``commit``;
        else ``verify``'s pending chunk, formed by ``commit``).

        Per layer one jit (``_step``: this layer's attention and MLP, then the next layer's projection) and one
        host round trip: the retrieval query comes back, the host picks and loads events (``_plan_memory``);
        then the head (``_head``) when needed.
        ``labels`` (the next tokens; None on the decode path) give the surprise; the head runs when surprise
        segmentation needs it or ``head`` asks for the logits ``[q_len, vocab]`` (returned; else None).
        """
        if self._verified:
            raise ValueError(f"{self._verified} verified tokens await commit(n) before the stream reads more")
        if self._weights.changed():
            if self._started:   # the memory holds KV of the old weights: never mix them with the new ones
                raise ValueError("the model's weights changed since this EM-LLM stream started (its memory holds "
                                 "KV of the old weights); call reset() to start a new stream with the new weights")
            self.reset()
        self._started = True
        cfg, n = self.cfg, len(tokens)
        # prefill chunks are padded to chunk_size (one shape), decode-path chunks (verify) to a power of two
        q_len = 1 if n == 1 else cfg.chunk_size if labels is not None else min(cfg.chunk_size,
                                                                                max(8, 1 << (n - 1).bit_length()))
        padded = np.zeros(q_len, np.int32)
        padded[:n] = tokens
        surprise_needed = labels is not None and cfg.memory and cfg.segmentation == "surprise"
        label_arr = None
        if surprise_needed:
            label_arr = np.zeros((1, q_len), np.int32)
            label_arr[0, :n] = labels
        seg, params = self.segmenter, self._params
        start, init_len = np.int32(seg.fill), np.int32(seg.init_len)
        x, q, k, v, q_mean = self._start(params.model, params.layers[0], padded[None], np.int32(n), self._inv_freq)
        num_layers = self.model_config.num_layers
        dense = None if self.decode_attention is None else self.decode_attention.dense_layers
        for layer in range(num_layers):
            plan = self._plan_memory(layer, q_mean, n)
            self.buffers[layer], last_weights, estimate, (x, q, k, v, q_mean) = self._step(
                params.layers[layer], params.layers[(layer + 1) % num_layers], self.buffers[layer],
                self.cache.k[layer], self.cache.v[layer], x, q, k, v, self._inv_freq, plan, start, np.int32(n),
                init_len, np.bool_(dense is not None and layer in dense))
            if self.decode_attention is not None and q_len == 1:
                self.estimates[layer] = estimate
            if self.diagnose:
                self.attention[layer] = (self._key_positions(layer, int(start), n), np.asarray(last_weights))
        logits = surprise = None
        if head or surprise_needed:
            logits, surprise = self._head(params.model, x, label_arr)
        if labels is not None:      # prefill: boundaries (uniform ones or from surprise); decode: none
            surprise = np.asarray(surprise)[:n] if surprise_needed else np.zeros(n, np.float32)
        if commit:
            self._update_memory(n, surprise)
        else:
            self._verified = n
        return logits

    def _key_positions(self, layer: int, start: int, n: int) -> np.ndarray:
        """Stream position of every key ``_attend`` sees (local window, then init, retrieved events and the
        buffer outside the window), -1 for padding: int64 ``[sum(kv_len_i)]``, aligned with its weights."""
        seg, cfg = self.segmenter, self.cfg
        slots = np.arange(self.buffer_len)
        buffered = np.where(slots < start + n, seg.start + slots, -1)
        if not cfg.memory:
            return buffered
        init = np.where(np.arange(max(cfg.n_init, 1)) < seg.init_len, np.arange(max(cfg.n_init, 1)), -1)
        events = np.full(cfg.memory_capacity, -1, np.int64)
        spans = [self.store.starts[i] + np.arange(self.store.sizes[i]) for i in self.retrieved[layer]]
        if spans:
            flat = np.concatenate(spans)
            events[:len(flat)] = flat
        return np.concatenate([buffered, init, events, buffered[:self.buffer_len - cfg.n_local]])

    def _plan_memory(self, layer: int, q_mean, n: int):
        """Choose this layer's events, make them device-resident, and lay them out in temporal order
        (``MemoryPlan``)."""
        cfg = self.cfg
        cap = cfg.memory_capacity
        slot_arr, off_arr = np.zeros(cap, np.int32), np.zeros(cap, np.int32)
        valid, pos = np.zeros(cap, bool), np.zeros(cap, np.int32)
        ids: list[int] = []
        if cfg.memory and len(self.store):
            sizes = self.store.sizes
            seg = self.segmenter
            cap_sim, cap_ctg = retrieval_budget(cfg, seg.fill, n, seg.init_len, seg.stream_len)
            if self.store.num_tokens <= cap_sim:
                similar = list(range(len(sizes)))
            else:
                ranked = self.store.rank(layer, np.asarray(q_mean), cap_sim // cfg.min_block_size + 2)
                similar = select_by_similarity(ranked, sizes, cap_sim)
            ids = similar
            if cfg.contiguity:
                ids = merge_temporal(self._contiguity[layer].update(similar, sizes, cap_ctg), similar)
            ids = merge_temporal(ids)
            slots = self.cache.load(layer, ids, self.store)
            filled = 0
            for event_id, slot in zip(ids, slots):
                size = sizes[event_id]
                slot_arr[filled:filled + size] = slot
                off_arr[filled:filled + size] = np.arange(size)
                filled += size
            valid[:filled] = True
            pos[:filled] = self.segmenter.init_len + np.arange(filled)
        self.retrieved[layer] = ids
        return MemoryPlan(slot_arr, off_arr, valid, pos, np.int32(self.segmenter.init_len + int(valid.sum())))

    # ------------------------------------------------------------------ memory formation
    def _update_memory(self, n: int, surprise: np.ndarray | None) -> None:
        """Boundaries, init tokens and events of the chunk (``EventSegmenter``), applied to the device buffers
        in one dispatch (``_cut``); event KV comes to the host in one transfer."""
        seg, cfg = self.segmenter, self.cfg
        graph_fn = None
        if cfg.refinement is not None:
            keys = jnp.stack([b.recent_k for b in self.buffers[cfg.refine_from_layer:]])
            graph_fn = lambda st, width: _chunk_similarity(keys, st, 2 * cfg.chunk_size)  # noqa: E731
        buffer_start, init_len = seg.start, seg.init_len
        cut = seg.push(n, surprise, graph_fn)
        if not cut.total:
            return
        sizes = list(cut.event_sizes)
        max_events = (cfg.chunk_size + cfg.max_block_size) // cfg.min_block_size + 1
        starts, size_arr = np.zeros(max_events, np.int32), np.zeros(max_events, np.int32)
        if sizes:
            starts[:len(sizes)] = cut.init + np.concatenate([[0], np.cumsum(sizes)[:-1]])
            size_arr[:len(sizes)] = sizes
        span = cfg.chunk_size + cfg.max_block_size if sizes else 0     # the most event tokens one cut can hold
        self.buffers, vectors, k, v = _cut(self.buffers, np.int32(init_len), np.int32(cut.init), np.int32(cut.init),
                                           starts, size_arr, np.int32(cut.total), np.int32(seg.fill), cfg.repr_topk,
                                           cfg.max_block_size, span)
        if not sizes:
            return
        k_host, v_host = np.asarray(k), np.asarray(v)
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        self.store.add([buffer_start + cut.init + int(b) for b in bounds[:-1]],
                       [k_host[:, a:b].copy() for a, b in zip(bounds[:-1], bounds[1:])],
                       [v_host[:, a:b].copy() for a, b in zip(bounds[:-1], bounds[1:])],
                       np.asarray(vectors)[:len(sizes)])
