"""Two-stage event retrieval: similarity under a token budget, plus a contiguity buffer of temporal neighbours.

EM-LLM, Fountas et al., ICLR 2025, §3.3 ("Memory recall": k-NN by similarity, then a contiguity buffer),
implemented as the reference ``context_manager.py`` does (research note ``em_llm.md`` §4.3):

- the budget is in tokens, not events: ``cap = n_init + chunk_size + n_mem - (memory-buffer tokens outside the
  local window) - (n_init if the stream is longer than n_local)``; with contiguity on, ``int(0.3·cap + 1)`` of it
  goes to the contiguity buffer;
- events are taken in similarity order until the budget is reached; the event that crosses it is kept only if
  that lands closer to the budget (closest fit); if all events fit, all are taken;
- neighbours ``b+1`` then ``b-1`` of the similar events fill the contiguity buffer with the same rule; the
  buffer persists across chunks (FIFO-like refill on overflow);
- the loaded events are the union, in temporal (event index) order.
"""
from __future__ import annotations

from collections.abc import Sequence

from rag_jax.memory.config import EMLLMConfig


def retrieval_budget(cfg: EMLLMConfig, buffer_len: int, q_len: int, init_len: int, stream_len: int
                     ) -> tuple[int, int]:
    """Token budgets ``(similarity_cap, contiguity_cap)`` for one retrieval (reference ``_calc_topk_blocks``).

    Args:
      buffer_len: tokens in the memory buffer (not yet formed into events, incl. the local window) before the
        chunk.
      q_len: tokens in the chunk.
      init_len: initial tokens stored so far.
      stream_len: tokens processed before the chunk.
    """
    outside_window = max(buffer_len + q_len - cfg.n_local, 0)
    cap = cfg.retrieval_cap - outside_window - (init_len if stream_len > cfg.n_local else 0)
    if not cfg.contiguity:
        return cap, 0
    ctg = int(cfg.contiguity_ratio * cap + 1) if cfg.contiguity_ratio < 1 else int(cfg.contiguity_ratio)
    return cap - ctg, ctg


def _closest_fit_walk(candidates, sizes, cap, exclude) -> tuple[list[int], int, bool]:
    """Append candidates (skipping ``exclude``, duplicates, out-of-range ids) until ``cap`` tokens are reached;
    the crossing event stays only if that is closer to ``cap``. Returns (ids, tokens, filled)."""
    picked, seen, total = [], set(), 0
    for cur in candidates:
        if cur in seen or cur in exclude or cur < 0 or cur >= len(sizes):
            continue
        picked.append(cur)
        seen.add(cur)
        prev, total = total, total + int(sizes[cur])
        if total >= cap:
            if abs(cap - prev) <= abs(total - cap):
                picked.pop()
                total = prev
            return picked, total, True
    return picked, total, False


def select_by_similarity(ranked_ids: Sequence[int], sizes: Sequence[int], cap: int) -> list[int]:
    """Events in similarity order until ``cap`` tokens (closest fit); all events when they fit.

    Args:
      ranked_ids: event ids, most similar first (may be a top-k prefix of the full ranking).
      sizes: tokens per event, indexed by event id.
      cap: token budget.
    """
    if sum(int(s) for s in sizes) <= cap:
        return list(range(len(sizes)))
    return _closest_fit_walk([int(i) for i in ranked_ids], sizes, cap, set())[0]


class ContiguityBuffer:
    """Temporal neighbours of recently retrieved events, kept across chunks (reference
    ``_update_contiguity_buffer``); one per layer."""

    def __init__(self):
        self.ids: list[int] = []

    def update(self, similar: Sequence[int], sizes: Sequence[int], cap: int) -> list[int]:
        """Add the neighbours (``b+1``, then ``b-1``) of ``similar`` (in rank order) within ``cap`` tokens;
        returns the buffer's event ids."""
        if not similar or cap <= 0:
            return self.ids
        similar_set = set(similar)
        candidates = [c for b in similar for c in (b + 1, b - 1)]
        new, total, filled = _closest_fit_walk(candidates, sizes, cap, similar_set)
        new.reverse()
        if not new:
            return self.ids
        if not self.ids or filled:
            self.ids = new
        elif sum(int(sizes[b]) for b in self.ids) + total < cap:
            self.ids = self.ids + [b for b in new if b not in self.ids]
        else:
            past = list(reversed(self.ids))
            self.ids = list(new)
            for cur in past:
                if cur in self.ids or cur in similar_set or cur < 0 or cur >= len(sizes):
                    continue
                self.ids.insert(0, cur)
                prev, total = total, total + int(sizes[cur])
                if total >= cap:
                    if abs(cap - prev) <= abs(total - cap):
                        self.ids.pop(0)
                    break
        return self.ids


def merge_temporal(*id_lists: Sequence[int]) -> list[int]:
    """Union of event ids in temporal order (events are numbered in stream order)."""
    return sorted({int(i) for ids in id_lists for i in ids})
