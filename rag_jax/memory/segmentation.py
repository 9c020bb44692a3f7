"""Surprise-based event segmentation (EM-LLM, Fountas et al., ICLR 2025, §3.1 "Memory formation via surprise").

A token starts a new event when its surprise exceeds ``T = mean + γ·std`` of the surprise over a trailing
window; events are then cut to ``[min_block_size, max_block_size]`` tokens. The behaviour follows the
reference code exactly (research note ``em_llm.md`` §2):

- surprise ``s[i] = -log p(x[i+1] | x[<=i])`` is stored at position ``i``; ``divide[i]`` makes token ``i`` the
  first token of a new event (so an event starts one token *before* the surprising token);
- the threshold is computed once per chunk over a window of the memory buffer (``threshold_window``), with
  the unbiased (N-1) standard deviation;
- ``form_events`` merges too-small events forward, splits long ones into ``max_block_size`` pieces, and
  always leaves the last segment unformed.
Here the statistics are computed in float64 (the reference uses the model dtype); inputs are stored in the
model dtype by the caller, as the reference stores them.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rag_jax.memory.config import EMLLMConfig
from rag_jax.memory.refinement import refine_boundaries


def surprise_from_logits(logits: jnp.ndarray, next_tokens: jnp.ndarray) -> jnp.ndarray:
    """Surprise ``-log softmax(logits)[next_token]``.

    Args:
      logits: float ``[batch, seq, vocab]``.
      next_tokens: int ``[batch, seq]``, the token that follows each position.

    Returns:
      float32 ``[batch, seq]`` (nats).
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, next_tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def threshold_window(buffer_end: int, chunk_len: int, n_local: int, n_init: int) -> tuple[int, int]:
    """Window ``[start, end)`` (indices into the memory buffer) whose surprise sets the chunk's threshold.

    ``buffer_end`` is the buffer length including the new chunk of ``chunk_len`` tokens. In steady state this is
    the ``n_local - chunk_len`` tokens just before the chunk; on the first chunk it is the chunk's first
    ``n_init`` tokens (reference ``update_memory``: ``avg_st = max(ed - n_local, 0)``,
    ``avg_ed = max(ed - exc_len, n_init)``). ``end`` may exceed ``buffer_end``; callers clip.
    """
    return max(buffer_end - n_local, 0), max(buffer_end - chunk_len, n_init)


def surprise_threshold(values: np.ndarray, gamma: float) -> float:
    """``mean + gamma * std(ddof=1)`` of ``values`` in float64; ``inf`` (no boundary) for fewer than 2 values,
    where the reference's unbiased std is NaN and every comparison is False."""
    values = np.asarray(values, np.float64)
    if values.size < 2:
        return float("inf")
    return float(values.mean() + gamma * values.std(ddof=1))


def boundary_flags(surprise: np.ndarray, threshold: float) -> np.ndarray:
    """bool ``[n]``: ``surprise > threshold`` (token ``i`` starts a new event)."""
    return np.asarray(surprise, np.float64) > threshold


def uniform_flags(chunk_len: int, max_block_size: int) -> np.ndarray:
    """InfLLM-style fixed blocks: a boundary every ``max_block_size`` tokens of the chunk (reference
    ``uniform_blocks``)."""
    flags = np.zeros(chunk_len, bool)
    flags[::max_block_size] = True
    return flags


def form_events(divide: np.ndarray, min_block_size: int, max_block_size: int) -> list[int]:
    """Sizes of the events cut from the front of the eligible tokens (reference ``update_memory``).

    Args:
      divide: bool ``[n]`` boundary flags of the tokens that have left the local window.
      min_block_size, max_block_size: event size bounds in tokens.

    Returns:
      Event sizes in order; their sum is the number of tokens consumed from the front. Segments shorter than
      ``min(min_block_size, n)`` merge into the next one, longer ones split into ``max_block_size`` pieces,
      and the last segment (after splitting) stays in the buffer for later chunks.
    """
    divide = np.asarray(divide, bool)
    n = divide.size
    if n == 0:
        return []
    idx = np.flatnonzero(divide)
    if idx.size == 0:
        idx = np.arange(0, n, max_block_size) if n > max_block_size else np.array([n])
    cuts = np.concatenate([[0], idx, [n]])
    sizes = np.diff(cuts)
    sizes = sizes[sizes != 0]
    events, acc = [], 0
    for k, size in enumerate(sizes):
        acc += int(size)
        while acc >= max_block_size:
            events.append(max_block_size)
            acc -= max_block_size
        if acc < min(min_block_size, n):
            continue
        if acc > 0 and k != len(sizes) - 1:
            events.append(acc)
        acc = 0
    return events


@dataclasses.dataclass(frozen=True)
class Cut:
    """What leaves the front of the memory buffer after a chunk: ``init`` tokens into the initial-token store,
    then events of ``event_sizes`` tokens, then ``discard`` tokens dropped (memory off). Buffer slots are
    counted before the cut."""

    init: int
    event_sizes: tuple[int, ...]
    discard: int = 0

    @property
    def total(self) -> int:
        return self.init + sum(self.event_sizes) + self.discard


class EventSegmenter:
    """Host bookkeeping of the memory buffer (reference ``update_memory``, note §2): per buffered token its
    surprise and boundary flag; after each chunk it decides the boundaries, the initial tokens to keep and the
    events to cut from the tokens that have left the local window.

    The buffer holds every token not yet in init or an event, in stream order (slot 0 = oldest), including the
    local window. ``graph_fn(first_slot, width)`` returns the similarity graph ``[>=width, >=width]`` of buffer
    slots ``first_slot..first_slot+width-1`` (needed only with ``refinement``).
    """

    def __init__(self, cfg: EMLLMConfig, capacity: int, surprise_dtype=np.float32):
        self.cfg = cfg
        self.surprise_dtype = surprise_dtype
        self.surprise = np.zeros(capacity, np.float32)
        self.divide = np.zeros(capacity, bool)
        self.fill = 0          # buffered tokens
        self.start = 0         # stream position of slot 0
        self.init_len = 0
        self.stream_len = 0    # tokens pushed

    def boundaries(self, n: int, surprise: np.ndarray | None, graph_fn=None) -> np.ndarray:
        """Boundary flags of the last ``n`` buffered tokens (their surprise already recorded)."""
        cfg, end = self.cfg, self.fill
        if surprise is None:
            return np.zeros(n, bool)
        if cfg.segmentation == "uniform":
            return uniform_flags(n, cfg.max_block_size)
        if cfg.refinement is not None and end <= n:   # first chunk: the chunk's own statistics (em_llm.py)
            st, ed = 0, end
        else:
            st, ed = threshold_window(end, n, cfg.n_local, cfg.n_init)
        divide = boundary_flags(surprise, surprise_threshold(self.surprise[st:min(ed, end)], cfg.surprise_gamma))
        if cfg.refinement is None or not divide.any():
            return divide
        offset = 0
        if cfg.refine_with_buffer and end >= 2 * n:
            previous = np.flatnonzero(self.divide[end - 2 * n:end - n])
            offset = n - (int(previous[-1]) if previous.size else n)
        graph = np.asarray(graph_fn(end - n - offset, n + offset))[:n + offset, :n + offset]
        refined = refine_boundaries(np.flatnonzero(divide), graph, cfg.refinement, cfg.min_block_size, offset)
        divide = np.zeros(n, bool)
        divide[refined] = True
        return divide

    def push(self, n: int, surprise: np.ndarray | None, graph_fn=None) -> Cut:
        """Record a chunk of ``n`` tokens (``surprise`` float ``[n]``, or None on the decode path: no boundaries)
        and return the cut; the bookkeeping already reflects it."""
        cfg = self.cfg
        if self.fill + n > len(self.surprise):
            raise ValueError(f"buffer overflow: {self.fill} + {n} tokens > capacity {len(self.surprise)}")
        start, end = self.fill, self.fill + n
        self.fill = end
        # Stored in the model dtype, as the reference stores surprisal.
        self.surprise[start:end] = 0.0 if surprise is None else np.asarray(surprise).astype(
            self.surprise_dtype).astype(np.float32)
        self.divide[start:end] = self.boundaries(n, surprise, graph_fn)

        init = 0
        if cfg.memory and self.init_len < cfg.n_init and end > cfg.n_local:
            init = min(cfg.n_init - self.init_len, end - cfg.n_local)
            self.init_len += init
        remaining, events, discard = end - init, [], 0
        if cfg.memory and remaining >= cfg.n_local + cfg.min_block_size:
            eligible = remaining - cfg.n_local
            events = form_events(self.divide[init:init + eligible], cfg.min_block_size, cfg.max_block_size)
        elif not cfg.memory and remaining > cfg.n_local:
            discard = remaining - cfg.n_local
        cut = Cut(init, tuple(events), discard)
        if cut.total:
            keep = end - cut.total
            for arr in (self.surprise, self.divide):
                arr[:keep] = arr[cut.total:end]
                arr[keep:] = 0
            self.fill = keep
            self.start += cut.total
        self.stream_len += n
        return cut
