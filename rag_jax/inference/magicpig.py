"""MagicPIG (Chen et al., ICLR 2025): decoding attention estimated from keys sampled by SimHash LSH.

At each decode step a query attends its cache in two parts:

- **exact**: the first ``sink_tokens`` valid tokens of the row (attention sinks), the last ``local_tokens``
  valid tokens of the prompt and every token decoded since (MagicPIG §5: sinks + local window on the GPU);
- **sampled**: the rest of the prompt (the "middle"). Each key there is hashed once, after prefill, by
  ``tables`` SimHash tables of ``bits`` random hyperplanes each (§4.1), on post-RoPE keys centred by the
  middle's mean key (the reference's ``avg_k``: softmax is invariant to the shift, the hash is not). The
  query is hashed by the same planes; a key is *sampled* when it falls in the query's bucket in at least
  ``min_collisions`` tables (the reference uses 2).

The estimator (§4.2) is importance sampling with the analytic inclusion probability: for a key at angle θ
to the query, one hyperplane agrees with probability ``p = 1 - θ/π``, one table with ``p^bits``, and the
number of colliding tables is Binomial(tables, p^bits), so ``u = P[Binomial(L, p^K) >= min_collisions]``.
With ``w = exp(q·k/√d)``, ``Σ_sampled (w/u) v`` is an unbiased (Horvitz-Thompson) estimate of the middle's
``Σ w v`` and ``Σ_sampled w/u`` of its ``Σ w``; the output is their self-normalized ratio joined with the
exact part, i.e. one softmax over logits ``q·k/√d - log u`` (sampled) and ``q·k/√d`` (exact).
``TopKDecode`` keeps instead the ``budget`` highest-scoring middle keys (the biased baseline of §3).

By default the sampling is evaluated densely (every middle key's collision count and score are computed):
exact to the method's distribution, not its speed. With ``bucket_size`` / ``max_sampled`` the keys are put in
bucket tables once (``prepare``: per table the slots sorted by bucket code and each bucket's offset, as the
reference's host-side tables), and each decode step reads only the query's bucket in every table (at most
``bucket_size`` slots each), counts collisions over those slots, and reads only the sampled keys (at most
``max_sampled``) and the exact part's keys: its score and value work scales with the keys used, not the cache. On
CPU (float32 caches) one C++ kernel does the whole step (``cpu_kernel.lsh_attend``: counts in a per-thread array
touched only at the bucket slots, scores, inclusion probabilities and softmax over the keys read); elsewhere JAX
(a scatter-add over the cache's slots for the counts, then gathers). Capacities that cut a bucket or the sample
leave keys out (an estimate biased by the cut); at or above the largest bucket and sample it equals the dense
evaluation. Both policies plug into ``generate(...,
decode_attention=...)`` over a plain cache and into ``memory.EMLLM(..., decode_attention=...)`` over EM-LLM's
window and memory (``decode_logits``: hashed per step, since the retrieved memory changes).
"""
from __future__ import annotations

import dataclasses
import math

import einops
import flax.struct
import jax
import jax.numpy as jnp

from rag_jax.model import cpu_kernel
from rag_jax.model.attention import attend_cache
from rag_jax.model.blockwise import MASK_VALUE
from rag_jax.model.kv import DecodeCache


def _check_layers(layers):
    if not isinstance(layers, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                for i in layers):
        raise ValueError(f"dense_layers={layers!r} must be a tuple of layer indices >= 0")


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")


@dataclasses.dataclass(frozen=True)
class MagicPIGDecode:
    """MagicPIG decode attention (hashable: a static argument of the jitted generation loop).

    Attributes:
      bits: SimHash bits per table (the paper's K; K=10 with L=150 samples ~2% of keys at 96K).
      tables: number of hash tables (L).
      min_collisions: tables a key must share the query's bucket in to be sampled (2 in the reference).
      sink_tokens, local_tokens: exact attention on the first / last prompt tokens (4 and 64 in the reference).
      seed: PRNG seed of the hyperplanes (``[head_dim, bits * tables]`` standard normal, shared by layers).
      dense_layers: layers that attend exactly (the reference keeps layers 0 and 16 of Llama-3.1-8B dense).
      bucket_size, max_sampled: 0 (both) evaluates the sampling densely; otherwise bucket tables (module doc):
        at most ``bucket_size`` slots read per table and query head, at most ``max_sampled`` keys sampled
        (the first by slot where more collide).

    Raises ValueError (one line, naming the field) on construction for a non-integer or out-of-range field.
    """

    bits: int = 10
    tables: int = 150
    min_collisions: int = 2
    sink_tokens: int = 4
    local_tokens: int = 64
    seed: int = 0
    dense_layers: tuple[int, ...] = ()
    bucket_size: int = 0
    max_sampled: int = 0

    def __post_init__(self):
        _check_layers(self.dense_layers)
        _check_int("bits", self.bits, 1)
        _check_int("bucket_size", self.bucket_size, 0)
        _check_int("max_sampled", self.max_sampled, 0)
        if (self.bucket_size == 0) != (self.max_sampled == 0):
            raise ValueError(f"bucket_size={self.bucket_size} and max_sampled={self.max_sampled} must both be 0 "
                             "(dense evaluation) or both >= 1 (bucket tables)")
        if self.bits > 30:
            raise ValueError(f"bits={self.bits} must be <= 30 (bucket codes are int32)")
        _check_int("tables", self.tables, 1)
        _check_int("min_collisions", self.min_collisions, 1)
        if self.min_collisions > self.tables:
            raise ValueError(f"min_collisions={self.min_collisions} must be <= tables={self.tables}")
        _check_int("sink_tokens", self.sink_tokens, 0)
        _check_int("local_tokens", self.local_tokens, 0)
        _check_int("seed", self.seed, 0)

    def prepare(self, cache: DecodeCache, prompt_end, key=None) -> "LSHIndex":
        """Hash the prompt's middle keys of every layer: ``cache`` right after prefill, ``prompt_end`` (int32
        scalar; a Python int with bucket tables, whose exact part has a static size) its first empty slot; ``key``
        a PRNG key for the planes (default ``jax.random.key(seed)``)."""
        middle = middle_slots(cache.segment_ids, prompt_end, self.sink_tokens, self.local_tokens)
        key = jax.random.key(self.seed) if key is None else key
        planes = hyperplanes(key, cache.k[0].shape[-1], self.bits, self.tables)
        means, codes, tables = [], [], []
        for k in cache.k:
            mean = masked_mean(k, middle)
            means.append(mean)
            codes.append(simhash(k - mean, planes, self.bits))
            if self.bucket_size:
                tables.append(bucket_tables(codes[-1], self.bits))
        if tables:        # the gathered path reads the tables, never the per-slot codes
            codes = [()] * len(codes)
        return LSHIndex(planes=planes, key_mean=tuple(means), codes=tuple(codes), middle=middle,
                        tables=tuple(tables), exact_slots=self.sink_tokens + self.local_tokens
                        + cache.k[0].shape[2] - int(prompt_end) if tables else 0)

    def sample(self, index: "LSHIndex", layer: int, q, kt):
        """Which keys layer ``layer``'s query samples and with what probability: q ``[batch, 1, num_heads,
        head_dim]`` (rotated), kt ``[batch, num_kv_heads, length, head_dim]`` -> ``(sampled bool, u float32)``,
        both ``[batch, num_kv_heads, heads_per_kv_head, length]``; ``sampled`` is restricted to the middle
        slots, ``u`` is the analytic inclusion probability of every slot's key."""
        qg = einops.rearrange(q, "b q (h g) d -> b h (g q) d", h=kt.shape[1]).astype(jnp.float32)
        count = collision_counts(simhash(qg, index.planes, self.bits), index.codes[layer])
        u = collision_probability(_cosine(qg, kt.astype(jnp.float32) - index.key_mean[layer]), self.bits,
                                  self.tables, self.min_collisions)
        return index.middle[:, None, None, :] & (count >= self.min_collisions), u

    def attend(self, index: "LSHIndex", layer: int, q, kt, vt, mask):
        """Layer ``layer``'s decode attention: q ``[batch, 1, num_heads, head_dim]`` (rotated), kt/vt the
        layer's heads-first cache ``[batch, num_kv_heads, length, head_dim]``, mask bool ``[batch, 1,
        length]`` (the causal decode mask) -> ``[batch, 1, num_heads, head_dim]`` in q's dtype."""
        if layer in self.dense_layers:
            return attend_cache(q, kt, vt, mask)
        if index.tables:
            return self._gathered(index, layer, q, kt, vt, mask)
        logits, scores, middle = _logits(q, kt, mask, index.middle)
        sampled, u = self.sample(index, layer, q, kt)
        log_u = jnp.log(jnp.maximum(u, jnp.finfo(jnp.float32).tiny))
        return _softmax_values(jnp.where(middle & sampled, scores - log_u, logits), vt, q)


    def _gathered(self, index: "LSHIndex", layer: int, q, kt, vt, mask):
        """``attend`` through the bucket tables: per query head, the slots of its bucket in each table (at most
        ``bucket_size``), their collision counts, the sampled middle keys (at most ``max_sampled``,
        ``_sampled_slots``) and the exact part (sinks, window, decoded tokens: ``index.exact_slots`` at most)
        gathered, one softmax over both with ``- log u`` on the sampled."""
        b, h, n, d = kt.shape
        qg = einops.rearrange(q, "b q (h g) d -> b h (g q) d", h=h).astype(jnp.float32)
        rows = b * h * qg.shape[2]
        order, offsets = index.tables[layer]                              # [b, h, L, n], [b, h, L, 2^K + 1]
        code = simhash(qg, index.planes, self.bits)                       # [b, h, g, L]
        if (jax.default_backend() == "cpu" and kt.dtype == vt.dtype == jnp.float32 and d % 16 == 0
                and cpu_kernel.available()):
            out = cpu_kernel.lsh_attend(qg, kt, vt, index.key_mean[layer], code, order, offsets,
                                        mask[:, 0] & index.middle, mask[:, 0] & ~index.middle,
                                        bucket_size=self.bucket_size, max_sampled=min(self.max_sampled, n),
                                        min_collisions=self.min_collisions, bits=self.bits)
            return einops.rearrange(out, "b h g d -> b 1 (h g) d").astype(q.dtype)
        s_idx, s_ok = self._sampled_slots(code, order, offsets, mask[:, 0] & index.middle)
        # the exact part is the same for every head of a batch row: compacted once per row, then broadcast
        e_idx, e_ok = (jnp.broadcast_to(x[:, None, None], (b, h, qg.shape[2], x.shape[-1])).reshape(rows, -1)
                       for x in _compact(mask[:, 0] & ~index.middle, min(index.exact_slots, n)))
        idx = jnp.concatenate([e_idx, s_idx], -1).reshape(b, h, qg.shape[2], -1)
        bi, hi = jnp.arange(b)[:, None, None, None], jnp.arange(h)[None, :, None, None]
        keys = kt[bi, hi, idx].astype(jnp.float32)                                         # [b, h, g, m, d]
        values = vt[bi, hi, idx]
        scores = jnp.einsum("bhgd,bhgmd->bhgm", qg, keys) * (d ** -0.5)
        cos = jnp.einsum("bhgd,bhgmd->bhgm", _unit(qg), _unit(keys - index.key_mean[layer][:, :, None]))
        u = collision_probability(cos, self.bits, self.tables, self.min_collisions)
        sampled = jnp.arange(idx.shape[-1]) >= e_idx.shape[-1]
        ok = jnp.concatenate([e_ok, s_ok], -1).reshape(idx.shape)
        logits = jnp.where(sampled, scores - jnp.log(jnp.maximum(u, jnp.finfo(jnp.float32).tiny)), scores)
        w = jax.nn.softmax(jnp.where(ok, logits, MASK_VALUE), axis=-1)
        out = jnp.einsum("bhgm,bhgmd->bhgd", w.astype(vt.dtype), values, preferred_element_type=jnp.float32)
        return einops.rearrange(out, "b h g d -> b 1 (h g) d").astype(q.dtype)

    def _sampled_slots(self, codes, order, offsets, keep):
        """The sampled slots of every query row, ``(idx int32, ok bool)`` ``[b * h * g, min(max_sampled, n)]``, the
        first in slot order: the keys ``keep`` (bool ``[b, n]``) allows that share the query's bucket (``codes``
        int32 ``[b, h, g, L]``) in at least ``min_collisions`` tables, reading at most ``bucket_size`` slots of
        each bucket of the tables ``order`` / ``offsets`` (a scatter-add of collision counts over the ``n`` slots
        and a prefix-sum compaction)."""
        b, h, g, tables = codes.shape
        n = order.shape[-1]
        size, rows = min(self.max_sampled, n), b * h * g
        # gathers by index arrays (one gather each; take_along_axis would broadcast the tables over g first)
        bi, hi = jnp.arange(b)[:, None, None, None, None], jnp.arange(h)[None, :, None, None, None]
        li = jnp.arange(tables)[None, None, None, :, None]
        code = codes[..., None]                                           # [b, h, g, L, 1]
        start, end = offsets[bi, hi, li, code], offsets[bi, hi, li, code + 1]
        slot = start + jnp.arange(min(self.bucket_size, n))               # [b, h, g, L, B]
        ids = order[bi, hi, li, jnp.minimum(slot, n - 1)]
        counts = jnp.zeros((rows, n), jnp.int32).at[jnp.arange(rows)[:, None], ids.reshape(rows, -1)].add(
            (slot < end).reshape(rows, -1).astype(jnp.int32))
        keep = jnp.broadcast_to(keep[:, None, None, :], (b, h, g, n)).reshape(rows, n)
        return _compact(keep & (counts >= self.min_collisions), size)


@dataclasses.dataclass(frozen=True)
class TopKDecode:
    """Decode attention over the sinks, the local window and the ``budget`` highest-scoring middle keys per
    query head (exact softmax over those; the TopK baseline MagicPIG §3 shows biased). Fields as
    ``MagicPIGDecode``; ``budget`` >= 0 keys."""

    budget: int = 256
    sink_tokens: int = 4
    local_tokens: int = 64
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self):
        _check_layers(self.dense_layers)
        _check_int("budget", self.budget, 0)
        _check_int("sink_tokens", self.sink_tokens, 0)
        _check_int("local_tokens", self.local_tokens, 0)

    def prepare(self, cache: DecodeCache, prompt_end) -> jax.Array:
        return middle_slots(cache.segment_ids, prompt_end, self.sink_tokens, self.local_tokens)

    def attend(self, middle, layer: int, q, kt, vt, mask):
        if layer in self.dense_layers:
            return attend_cache(q, kt, vt, mask)
        logits, scores, middle = _logits(q, kt, mask, middle)
        return _softmax_values(jnp.where(topk_keep(scores, middle, self.budget), scores, logits), vt, q)


@flax.struct.dataclass
class LSHIndex:
    """The hashed prompt (a pytree built once per prompt by ``MagicPIGDecode.prepare``).

    Attributes:
      planes: float32 ``[head_dim, bits * tables]`` hyperplanes.
      key_mean: per layer float32 ``[batch, num_kv_heads, 1, head_dim]``, the mean middle key.
      codes: per layer int32 ``[batch, num_kv_heads, length, tables]`` bucket of every slot's key (``()`` per
        layer where ``tables`` is filled).
      middle: bool ``[batch, length]``, the slots attended by sampling.
      tables: per layer ``bucket_tables`` (``()`` for the dense evaluation).
      exact_slots: static, the most slots the exact part can hold (sinks + window + decode slots).
    """

    planes: jax.Array
    key_mean: tuple
    codes: tuple
    middle: jax.Array
    tables: tuple = ()
    exact_slots: int = flax.struct.field(pytree_node=False, default=0)


def bucket_tables(codes, bits: int) -> tuple[jax.Array, jax.Array]:
    """Bucket tables of ``codes`` (int32 ``[b, kv_heads, length, tables]``): ``(order, offsets)``, int32
    ``[b, kv_heads, tables, length]`` the slots sorted by their code in each table and ``[b, kv_heads, tables,
    2^bits + 1]`` where each code's run starts (bucket ``c`` of table ``t`` = ``order[..., t, offsets[..., t, c]:
    offsets[..., t, c + 1]]``)."""
    by_table = jnp.swapaxes(codes, -1, -2)
    order = jnp.argsort(by_table, axis=-1, stable=True).astype(jnp.int32)
    sizes = jnp.vectorize(lambda c: jnp.bincount(c, length=2 ** bits), signature="(n)->(m)")(by_table)
    offsets = jnp.concatenate([jnp.zeros(sizes.shape[:-1] + (1,), jnp.int32), jnp.cumsum(sizes, -1)], -1)
    return order, offsets.astype(jnp.int32)


def decode_logits(policy, q, kt, mask, middle) -> jax.Array:
    """One decode query's logits for one softmax over keys hashed on the fly (each call: for a cache whose keys
    change every step, as EM-LLM's retrieved memory does), float32 ``[b, kv_heads, group, length]``: the
    ``middle`` slots estimated by ``policy`` (``MagicPIGDecode``: sampled keys keep their score minus ``log u``,
    the rest masked; ``TopKDecode``: its ``budget`` best kept), every other slot of ``mask`` exact, masked slots
    ``MASK_VALUE``. ``policy=None``: every slot of ``mask`` exact. q ``[b, 1, num_heads, head_dim]`` (rotated),
    kt ``[b, kv_heads, length, head_dim]``, mask bool ``[b, 1, length]``, middle bool ``[b, length]``. The
    planes come from ``policy.seed`` and the keys are centred by the middle's mean, as ``prepare`` does."""
    logits, scores, mid = _logits(q, kt, mask, middle)
    if policy is None:
        return jnp.where(mid, scores, logits)
    if isinstance(policy, TopKDecode):
        return jnp.where(topk_keep(scores, mid, policy.budget), scores, logits)
    planes = hyperplanes(jax.random.key(policy.seed), kt.shape[-1], policy.bits, policy.tables)
    mean = masked_mean(kt, middle)
    index = LSHIndex(planes=planes, key_mean=(mean,), codes=(simhash(kt - mean, planes, policy.bits),),
                     middle=middle)
    sampled, u = policy.sample(index, 0, q, kt)
    return jnp.where(mid & sampled, scores - jnp.log(jnp.maximum(u, jnp.finfo(jnp.float32).tiny)), logits)


def hyperplanes(key, head_dim: int, bits: int, tables: int) -> jax.Array:
    """Standard-normal SimHash planes, float32 ``[head_dim, bits * tables]`` (table t uses columns
    ``t*bits ... t*bits + bits - 1``)."""
    return jax.random.normal(key, (head_dim, bits * tables), jnp.float32)


def simhash(x, planes, bits: int) -> jax.Array:
    """Bucket codes of ``x [..., head_dim]``: int32 ``[..., tables]``, bit j of table t set where
    ``x · planes[:, t*bits + j] > 0``."""
    signs = (jnp.einsum("...d,dn->...n", x.astype(jnp.float32), planes) > 0).astype(jnp.int32)
    signs = signs.reshape(*signs.shape[:-1], -1, bits)
    return (signs << jnp.arange(bits, dtype=jnp.int32)).sum(-1)


def collision_counts(q_codes, k_codes) -> jax.Array:
    """Tables in which each key shares the query's bucket: q_codes ``[b, kv_heads, m, tables]``, k_codes
    ``[b, kv_heads, length, tables]`` -> int32 ``[b, kv_heads, m, length]`` (one fused compare-and-sum: the
    ``[m, length, tables]`` comparison is never held)."""
    return jnp.sum(q_codes[..., :, None, :] == k_codes[..., None, :, :], axis=-1, dtype=jnp.int32)


def collision_probability(cos, bits: int, tables: int, min_collisions: int) -> jax.Array:
    """``P[Binomial(tables, p^bits) >= min_collisions]`` with ``p = 1 - arccos(cos)/π``: the probability
    that a key at cosine ``cos`` to the query is sampled (MagicPIG §4.2), float32, ``cos``'s shape.

    With ``r = p^bits``, ``L = tables``, ``m = min_collisions``: where ``m <= L r`` (the tail holds at least about
    half the mass) ``1 - Σ_{j<m} C(L,j) r^j (1-r)^(L-j)``; elsewhere the upper tail summed from its first term
    ``C(L,m) r^m (1-r)^(L-m)`` (in log space) by the terms' ratio ``(L-j)/(j+1) · r/(1-r)``, which stays below 1
    there, for ``16 + 4 sqrt(L)`` terms (past 8 standard deviations): no cancellation where the probability is
    small, closed form in elementwise operations (``betainc``'s continued fraction cost ~11 ms per layer and
    decode step at 4K keys)."""
    L, m = int(tables), int(min_collisions)
    p = 1.0 - jnp.arccos(jnp.clip(cos.astype(jnp.float32), -1.0, 1.0)) / jnp.pi
    r = p ** bits
    log_r, log_1mr = jnp.log(r), jnp.log1p(-r)
    lower = sum(jnp.exp(math.lgamma(L + 1) - math.lgamma(j + 1) - math.lgamma(L - j + 1) + j * log_r
                        + (L - j) * log_1mr) for j in range(m))
    odds = r / (1.0 - r)
    term, series = jnp.ones_like(r), jnp.ones_like(r)
    for j in range(m, min(L, m + 16 + 4 * math.isqrt(L) + 1)):
        term = term * ((L - j) / (j + 1)) * odds
        series = series + term
    first = math.lgamma(L + 1) - math.lgamma(m + 1) - math.lgamma(L - m + 1) + m * log_r + (L - m) * log_1mr
    upper = jnp.exp(first) * series
    return jnp.where(L * r >= m, 1.0 - lower, upper).astype(jnp.float32)


def middle_slots(segment_ids, prompt_end, sink_tokens: int, local_tokens: int) -> jax.Array:
    """bool ``[batch, length]``: the valid prompt slots (before ``prompt_end``, the first slot after the prompt)
    that are neither among the row's first ``sink_tokens`` valid tokens nor among its last ``local_tokens``
    valid prompt tokens (padding is never counted)."""
    slot = jnp.arange(segment_ids.shape[1])[None, :]
    valid = (segment_ids != 0) & (slot < prompt_end)
    rank = jnp.cumsum(valid, axis=1) - 1
    from_end = valid.sum(1, keepdims=True) - 1 - rank
    return valid & (rank >= sink_tokens) & (from_end >= local_tokens)


def masked_mean(kt, middle) -> jax.Array:
    """Mean key over the middle slots: kt ``[b, kv_heads, length, d]`` -> float32 ``[b, kv_heads, 1, d]``
    (zero where a row has no middle)."""
    w = middle[:, None, :, None].astype(jnp.float32)
    return (kt.astype(jnp.float32) * w).sum(2, keepdims=True) / jnp.maximum(w.sum(2, keepdims=True), 1.0)


def topk_keep(scores, middle, budget: int) -> jax.Array:
    """bool, ``scores``' shape ``[..., length]``: the ``budget`` highest scores among middle slots (ties at
    the threshold kept)."""
    if budget == 0:
        return jnp.zeros(scores.shape, bool)
    masked = jnp.where(middle, scores, -jnp.inf)
    kth = jax.lax.top_k(masked, min(budget, scores.shape[-1]))[0][..., -1:]
    return middle & (masked >= kth)


def _logits(q, kt, mask, middle):
    """Exact-part logits (middle slots masked out), raw scores and the middle mask, all
    ``[b, kv_heads, group, length]`` (one query per row)."""
    if q.shape[1] != 1:
        raise ValueError(f"decode attention takes one query per row; got q_len={q.shape[1]}")
    num_kv_heads = kt.shape[1]
    qg = einops.rearrange(q, "b q (h g) d -> b h (g q) d", h=num_kv_heads)
    scores = jnp.einsum("bhmd,bhkd->bhmk", qg, kt, preferred_element_type=jnp.float32) * (q.shape[-1] ** -0.5)
    allowed = mask[:, None, :, :]                     # [b, 1, 1, length]
    mid = allowed & middle[:, None, None, :]
    return jnp.where(allowed & ~mid, scores, MASK_VALUE), scores, mid


def _cosine(qg, kc):
    """Cosine between each query ``[b, h, m, d]`` and key ``[b, h, length, d]`` -> ``[b, h, m, length]``."""
    return jnp.einsum("bhmd,bhkd->bhmk", _unit(qg), _unit(kc))


def _compact(keep, size: int) -> tuple[jax.Array, jax.Array]:
    """The first ``size`` True slots of each row of ``keep`` (bool ``[rows, n]``), in slot order: int32
    ``[rows, size]`` slot ids (the last slot past the row's count) and bool ``[rows, size]`` which are real."""
    count = jnp.cumsum(keep, axis=-1, dtype=jnp.int32)             # the j-th True is where count first reaches j
    idx = jax.vmap(lambda c: jnp.searchsorted(c, jnp.arange(1, size + 1, dtype=jnp.int32), side="left"))(count)
    return jnp.minimum(idx, keep.shape[1] - 1).astype(jnp.int32), jnp.arange(size) < count[:, -1:]


def _unit(x):
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-30)


def _softmax_values(logits, vt, q):
    """softmax(logits) @ v for logits ``[b, kv_heads, group, length]`` -> ``[b, 1, num_heads, head_dim]``."""
    w = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhmk,bhkd->bhmd", w.astype(vt.dtype), vt, preferred_element_type=jnp.float32)
    return einops.rearrange(out, "b h g d -> b 1 (h g) d").astype(q.dtype)
