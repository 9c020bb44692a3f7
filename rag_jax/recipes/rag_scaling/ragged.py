"""RAGGED-style summaries of a reader's accuracy against retrieval depth k (Hsia et al., ICML 2025, §4-5).

RAGGED names two reader behaviours, "improve then plateau" and "peak then decline", and summarises a curve by a
stability score and a scalability coefficient. This module's operationalisation, on a grid of depths ``ks``
(k = 0, closed book, included) with per-question correctness:

- ``k*``: the depth of the highest accuracy (the smallest such k).
- **stability**: the mean of ``acc(k) / acc(k*)`` over ``k*`` and its neighbouring retrieving depths on the grid,
  one step either side (a symmetric window; on a log-spaced grid, a factor of about 3 each way); 1 = flat around
  the peak.
- **scalability**: accuracy gained per doubling of k from the smallest retrieving depth to ``k*`` (least-squares
  slope against log2 k; 0 when ``k*`` is the smallest retrieving depth or closed book).
- **behaviour**: ``peak then decline`` when the deepest k is below ``k*`` by a significant exact McNemar test
  (p < ``alpha``), else ``improve then plateau``; ``no gain from retrieval`` when the best retrieving depth is
  not significantly above closed book (or there is no k = 0 row, when it is not above the smallest k).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rag_jax.evaluation.stats import mcnemar


def ragged_scores(ks: Sequence[int], correct: Sequence[Sequence[bool]], alpha: float = 0.05) -> dict:
    """Summaries of one reader's depth curve (module docstring).

    Args:
      ks: increasing depths; ``correct[j]``: per-question correctness at ``ks[j]`` (the same questions, in order).

    Returns:
      ``{"k_star", "peak", "stability", "scalability", "behaviour", "decline_p", "gain_p", "accuracy": [..]}``.

    Raises:
      ValueError: ks not strictly increasing, fewer than 2 depths, or rows of unequal length.
    """
    ks = [int(k) for k in ks]
    if len(ks) < 2 or any(b <= a for a, b in zip(ks, ks[1:])) or ks[0] < 0:
        raise ValueError(f"ks={ks} must be at least 2 strictly increasing depths >= 0")
    rows = [np.asarray(c, bool) for c in correct]
    if len(rows) != len(ks) or len({r.size for r in rows}) != 1:
        raise ValueError(f"correct must hold one row per depth ({len(ks)}) of equal length")
    acc = np.array([r.mean() for r in rows])
    retrieving = [j for j, k in enumerate(ks) if k > 0]
    star = max(retrieving, key=lambda j: (acc[j], -j))
    k_star, peak = ks[star], float(acc[star])
    window = [j for j in retrieving if abs(j - star) <= 1]
    stability = float(np.mean(acc[window] / peak)) if peak > 0 else float("nan")
    up = [j for j in retrieving if ks[j] <= k_star]
    scalability = (float(np.polyfit(np.log2([ks[j] for j in up]), acc[up], 1)[0]) if len(up) > 1 else 0.0)
    _, _, decline_p = mcnemar(rows[star], rows[-1])
    base = 0 if ks[0] == 0 else retrieving[0]
    gain_a, gain_b, gain_p = mcnemar(rows[star], rows[base])
    if star == base or not (gain_a > gain_b and gain_p < alpha):
        behaviour = "no gain from retrieval"
    elif star != len(ks) - 1 and acc[-1] < peak and decline_p < alpha:
        behaviour = "peak then decline"
    else:
        behaviour = "improve then plateau"
    return {"k_star": k_star, "peak": peak, "stability": stability, "scalability": scalability,
            "behaviour": behaviour, "decline_p": float(decline_p), "gain_p": float(gain_p),
            "accuracy": acc.tolist()}
