"""RAPID: retrieval-augmented speculative decoding (Chen et al., ICML 2025, "Long-Context Inference with
Retrieval-Augmented Speculative Decoding"; reference code ``John-AI-Lab/RAPID``, ``src/utils.py``
``_speculative_sampling``).

A **drafter** reads a short retrieved context (RAG) and proposes ``gamma`` tokens; the **target** reads the long
context and verifies them (Leviathan et al., 2023, Algorithm 1). RAPID's inference-time knowledge transfer (§3.2)
moves the target's logits toward the drafter's before acceptance::

    z~ = z_p - eta * m * (p - q),   p = softmax(z_p), q = softmax(z_q),   m = [q >= alpha * max q]

(the reference code's ``adjust_logits = student_logits - m * truncate_g``: a gradient step of KL(q || softmax(z))
restricted to the drafter's plausible tokens). A drafted token ``x`` is accepted with probability
``min(1, p~(x) / q(x))``; at the first rejection the replacement is drawn from ``normalize(max(p - q, p - p~)+)``
(the reference's ``p_prime``); when every drafted token is accepted, one more token is drawn from the target's
``p``. With ``eta = 0`` this is plain speculative sampling and the output distribution is exactly the target's
(``output_distribution``); with ``eta > 0`` it leans toward the drafter. Greedy decoding (``temperature=0``)
accepts a drafted token when it is the argmax of ``p~`` and otherwise emits that argmax: with ``eta = 0`` the
output is the target's own greedy output, token for token.

``rapid_generate`` runs the loop for one prompt over the fixed-size decode caches (``inference.generate.prefill``,
``Transformer.decode``, jitted once per model, cache size and token count). The drafter decodes one token at a
time; the target verifies a whole round in one decode call of ``gamma + 1`` tokens (the token emitted at the end
of the last round, which it has not read yet, and the drafts), as speculative decoding needs to pay: one read of
the target's weights and long KV cache per round instead of per token. The target may also be a streaming
long-context model (``memory.EMLLM``, for inputs beyond the model's context): it reads each round with
``EMLLM.verify`` (one chunk, one retrieval) and keeps the accepted prefix with ``EMLLM.commit``.
``decode_bytes`` gives the bytes each decode step reads, from which the context length where speculation can pay
is computed.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rag_jax.inference.generate import decode_step, prefill
from rag_jax.model.transformer import count_params
from rag_jax.tokenizer import eos_tuple


def _softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _check_transfer(eta: float, alpha: float) -> None:
    if eta < 0:
        raise ValueError(f"eta={eta} must be >= 0")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must be in [0, 1]")


def transfer_logits(target_logits, draft_logits, eta: float, alpha: float = 0.1) -> np.ndarray:
    """RAPID's retrieval-augmented target logits ``z~`` (module docstring), float64 ``[..., vocab]``.

    Raises:
      ValueError: ``eta < 0`` or ``alpha`` outside [0, 1].
    """
    _check_transfer(eta, alpha)
    z = np.asarray(target_logits, np.float64)
    p, q = _softmax(z), _softmax(draft_logits)
    m = q >= alpha * q.max(axis=-1, keepdims=True)
    return z - eta * np.where(m, p - q, 0.0)


def accept_probability(token: int, target_logits, draft_logits, eta: float, alpha: float = 0.1) -> float:
    """``min(1, p~(token) / q(token))`` for one drafted token (logits ``[vocab]``)."""
    q = _softmax(draft_logits)[token]
    pt = _softmax(transfer_logits(target_logits, draft_logits, eta, alpha))[token]
    return float(min(1.0, pt / q)) if q > 0 else 1.0


def residual(target_logits, draft_logits, eta: float, alpha: float = 0.1) -> np.ndarray:
    """The replacement distribution after a rejection: ``normalize(max(p - q, p - p~)+)`` (float64 ``[vocab]``);
    ``p`` where that is all zero (p equal to q and to p~)."""
    p, q = _softmax(target_logits), _softmax(draft_logits)
    pt = _softmax(transfer_logits(target_logits, draft_logits, eta, alpha))
    r = np.clip(np.maximum(p - q, p - pt), 0.0, None)
    return r / r.sum() if r.sum() > 0 else p


def output_distribution(target_logits, draft_logits, eta: float, alpha: float = 0.1) -> np.ndarray:
    """The exact distribution of the token one verification step emits at a drafted position: the drafted token
    ``x ~ q`` kept with ``min(1, p~/q)``, else a draw from ``residual`` (float64 ``[vocab]``). Equals the target's
    ``p`` when ``eta = 0`` (speculative sampling is exact)."""
    q = _softmax(draft_logits)
    pt = _softmax(transfer_logits(target_logits, draft_logits, eta, alpha))
    kept = np.minimum(q, pt)
    return kept + (1.0 - kept.sum()) * residual(target_logits, draft_logits, eta, alpha)


def decode_bytes(config, context_tokens: int, dtype_bytes: int = 4) -> dict[str, int]:
    """Bytes one decode step of ``config``'s model reads: ``weights`` (every parameter once) and ``kv`` (keys and
    values of ``context_tokens`` cached tokens, all layers)."""
    c = config
    params = count_params(c)
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * context_tokens
    return {"weights": params * dtype_bytes, "kv": kv * dtype_bytes}


@dataclasses.dataclass
class RapidStats:
    """Attributes: rounds (draft-verify rounds), drafted / accepted (drafted tokens and those kept),
    target_steps / draft_steps (decode calls run: the target's one per round), seconds (wall time after both prefills), prefill_seconds."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    target_steps: int = 0
    draft_steps: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@functools.partial(jax.jit, static_argnames=("graphdef", "slots"))
def _prefill(graphdef, state, tokens, slots):
    model = nnx.merge(graphdef, state)
    n = tokens.shape[1]
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    return prefill(model, tokens, positions, jnp.ones_like(tokens), None, slots)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _step(graphdef, state, cache, token, position, slot):
    model = nnx.merge(graphdef, state)
    return decode_step(model, cache, token[None], position[None], slot)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _steps(graphdef, state, cache, tokens, positions, slot):
    return nnx.merge(graphdef, state).decode(tokens[None], positions[None], cache, slot)


class _Stream:
    """One model decoding one sequence over a fixed ``DecodeCache``: ``logits`` predict the next token; ``feed``
    appends a token; ``rewind(n)`` drops the last ``n`` fed tokens (their slots are rewritten later and, being
    after the current slot, never attended). The decode calls (one token; ``widths`` tokens at once) are compiled
    with the prefill, so the time after it is decoding alone."""

    def __init__(self, model, prompt: Sequence[int], slots: int, widths: Sequence[int] = ()):
        self.graphdef, self.state = nnx.split(model)
        logits, self.cache, first = _prefill(self.graphdef, self.state, jnp.asarray([list(prompt)], jnp.int32), slots)
        self.first, self.fed, self.next_position = int(first), 0, len(prompt)
        self.logits = np.asarray(logits[0], np.float64)
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        self._step = _step.lower(self.graphdef, self.state, self.cache, i32, i32, i32).compile()
        self._steps = {w: _steps.lower(self.graphdef, self.state, self.cache, jax.ShapeDtypeStruct((w,), jnp.int32),
                                       jax.ShapeDtypeStruct((w,), jnp.int32), i32).compile() for w in widths}

    def feed(self, token: int) -> np.ndarray:
        logits, self.cache = self._step(self.state, self.cache, jnp.int32(token),
                                        jnp.int32(self.next_position + self.fed), jnp.int32(self.first + self.fed))
        self.fed += 1
        self.logits = np.asarray(logits[0], np.float64)
        return self.logits

    def feed_many(self, tokens: Sequence[int]) -> np.ndarray:
        """Append ``tokens`` in one decode call; float64 ``[len(tokens), vocab]``: the logits after each."""
        at = self.next_position + self.fed
        steps = self._steps.get(len(tokens)) or functools.partial(_steps, self.graphdef)
        logits, self.cache = steps(self.state, self.cache, jnp.asarray(tokens, jnp.int32),
                                   jnp.arange(at, at + len(tokens), dtype=jnp.int32), jnp.int32(self.first + self.fed))
        self.fed += len(tokens)
        rows = np.asarray(logits[0], np.float64)
        self.logits = rows[-1]
        return rows

    def rewind(self, n: int, logits: np.ndarray):
        self.fed -= n
        self.logits = logits


class _MemoryStream:
    """A streaming long-context target (``memory.EMLLM`` or anything with its ``reset`` / ``prefill`` / ``step`` /
    ``verify`` / ``commit``) behind ``_Stream``'s interface: ``feed_many`` verifies, and the ``rewind`` that
    follows it commits the tokens kept (``EMLLM.verify``: one retrieval per verified chunk)."""

    def __init__(self, target, prompt: Sequence[int]):
        target.reset()
        self.target, self._verified = target, 0
        self.logits = np.asarray(target.prefill(np.asarray(prompt, np.int32)), np.float64)

    def feed(self, token: int) -> np.ndarray:
        self.logits = np.asarray(self.target.step(int(token)), np.float64)
        return self.logits

    def feed_many(self, tokens: Sequence[int]) -> np.ndarray:
        rows = np.asarray(self.target.verify(np.asarray(tokens, np.int32)), np.float64)
        self._verified, self.logits = len(tokens), rows[-1]
        return rows

    def rewind(self, n: int, logits: np.ndarray):
        self.target.commit(self._verified - n)
        self._verified, self.logits = 0, logits


def _open_stream(model, prompt: Sequence[int], slots: int, widths: Sequence[int] = ()):
    """``_MemoryStream`` for a streaming target (it has ``verify``), else ``_Stream`` over ``slots`` decode slots."""
    return _MemoryStream(model, prompt) if hasattr(model, "verify") else _Stream(model, prompt, slots, widths)


def rapid_generate(target, target_prompt: Sequence[int], drafter, draft_prompt: Sequence[int], *,
                   max_new_tokens: int, gamma: int = 4, eta: float = 0.0, alpha: float = 0.1,
                   temperature: float = 0.0, eos_id: int | Sequence[int] | None = None,
                   seed: int = 0) -> tuple[list[int], RapidStats]:
    """RAPID decoding of one prompt (module docstring): ``target`` reads ``target_prompt`` (the long context),
    ``drafter`` reads ``draft_prompt`` (the retrieved chunks + question); both share the tokenizer.

    Args:
      target, drafter: ``Transformer``s (the same one may serve both); the target may instead be a streaming
        long-context model (``memory.EMLLM``: it is reset, prefilled with ``target_prompt`` and verifies each
        round with ``verify`` / ``commit``).
      target_prompt, draft_prompt: token ids.
      max_new_tokens: tokens emitted at most (fewer when an ``eos_id`` is emitted, which is included).
      gamma: tokens drafted per round (>= 1).
      eta, alpha: the knowledge-transfer margin and the drafter's plausibility cut (``transfer_logits``).
      temperature: 0 = greedy verification; otherwise logits are divided by it and sampled (NumPy, ``seed``).

    Returns ``(emitted token ids, RapidStats)``.

    Raises:
      ValueError: ``gamma < 1``, ``max_new_tokens < 1``, ``temperature < 0``, an empty prompt, or a bad
        ``eta``/``alpha``, before any compute.
    """
    if gamma < 1 or max_new_tokens < 1:
        raise ValueError(f"gamma={gamma} and max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if not len(target_prompt) or not len(draft_prompt):
        raise ValueError("target_prompt and draft_prompt must be non-empty token lists")
    _check_transfer(eta, alpha)
    eos = set(eos_tuple(eos_id))
    rng = np.random.default_rng(seed)
    scale = (lambda z: z / temperature) if temperature > 0 else (lambda z: z)

    def pick(dist_logits) -> int:
        z = scale(dist_logits)
        return int(np.argmax(z)) if temperature == 0 else int(rng.choice(len(z), p=_softmax(z)))

    def rule(x: int, target_logits, draft_logits) -> tuple[bool, int | None]:
        """(accept the drafted ``x``?, the replacement when not)."""
        zp, zq = scale(target_logits), scale(draft_logits)
        if temperature == 0:
            best = int(np.argmax(transfer_logits(zp, zq, eta, alpha)))
            return x == best, best
        if rng.random() <= accept_probability(x, zp, zq, eta, alpha):
            return True, None
        return False, int(rng.choice(len(zp), p=residual(zp, zq, eta, alpha)))

    t0 = time.perf_counter()
    slots = max_new_tokens + gamma + 1
    tgt = _open_stream(target, target_prompt, slots, widths=(gamma, gamma + 1))
    dft = _Stream(drafter, draft_prompt, slots + gamma)
    stats = RapidStats(prefill_seconds=time.perf_counter() - t0)
    t0 = time.perf_counter()
    out: list[int] = []
    pending = None                        # the token emitted last, not yet read by the target
    while len(out) < max_new_tokens and not (out and out[-1] in eos):
        stats.rounds += 1
        drafts, qs = [], []
        for i in range(gamma):
            qs.append(dft.logits)
            drafts.append(pick(dft.logits))
            if i < gamma - 1:
                dft.feed(drafts[-1])
                stats.draft_steps += 1
        stats.drafted += gamma
        emitted, accepted, pending = _verify(tgt, pending, drafts, qs, rule, pick, eos, max_new_tokens - len(out),
                                             stats)
        stats.accepted += accepted
        # The drafter fed drafts[:gamma-1]; keep those accepted (its logits after them are qs[keep]), feed the rest.
        keep = min(accepted, gamma - 1)
        dft.rewind(gamma - 1 - keep, qs[keep])
        for token in emitted[keep:]:
            dft.feed(token)
            stats.draft_steps += 1
        out.extend(emitted)
    stats.seconds = time.perf_counter() - t0
    return out[:max_new_tokens], stats


def stream_generate(model, prompt: Sequence[int], *, max_new_tokens: int,
                    eos_id: int | Sequence[int] | None = None) -> tuple[list[int], RapidStats]:
    """Greedy decoding of ``prompt`` by ``model`` alone (a ``Transformer`` or a streaming target, as
    ``rapid_generate``'s), one token per decode call through the same compiled prefill and decode step as
    ``rapid_generate`` (its baseline for decode tokens/s). Returns ``(emitted token ids,
    RapidStats)`` with ``seconds`` / ``prefill_seconds`` and ``target_steps`` set.

    Raises:
      ValueError: ``max_new_tokens < 1`` or an empty prompt, before any compute."""
    if max_new_tokens < 1 or not len(prompt):
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1 and the prompt non-empty "
                         f"(got {len(prompt)} tokens)")
    eos = set(eos_tuple(eos_id))
    t0 = time.perf_counter()
    stream = _open_stream(model, prompt, max_new_tokens)
    stats = RapidStats(prefill_seconds=time.perf_counter() - t0)
    t0 = time.perf_counter()
    out = [int(np.argmax(stream.logits))]
    while len(out) < max_new_tokens and out[-1] not in eos:
        out.append(int(np.argmax(stream.feed(out[-1]))))
        stats.target_steps += 1
    stats.seconds = time.perf_counter() - t0
    return out, stats


def _verify(tgt: _Stream, pending, drafts, qs, rule, pick, eos, room: int, stats: RapidStats):
    """One verification round in one target call: the target reads ``pending`` (the last round's final token,
    None in the first round) and every drafted token, then checks ``drafts`` in order (``rule``) against its logits
    before each; it stops at the first rejection (emitting the replacement), an end token or ``room`` tokens, and
    after a fully accepted round emits one more token of its own (``pick``). The rejected drafts are rewound out of
    its cache. Returns ``(emitted tokens, drafted tokens accepted, the new pending token or None)``."""
    fed = ([] if pending is None else [pending]) + list(drafts)
    before = tgt.logits
    rows = tgt.feed_many(fed)
    stats.target_steps += 1
    if pending is not None:
        before, rows = rows[0], rows[1:]
    emitted, accepted = [], 0
    for x, q, p in zip(drafts, qs, [before, *rows[:-1]]):
        ok, replacement = rule(x, p, q)
        emitted.append(x if ok else replacement)
        accepted += ok
        if not ok or emitted[-1] in eos or len(emitted) >= room:
            break
    else:
        emitted.append(pick(rows[-1]))
    tgt.rewind(len(drafts) - accepted, rows[accepted - 1] if accepted else before)
    return emitted, accepted, (emitted[-1] if len(emitted) > accepted else None)
