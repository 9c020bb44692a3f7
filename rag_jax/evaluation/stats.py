"""Paired significance tests for comparing two systems on the same questions (claims with statistics)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mcnemar(a_correct: Sequence[bool], b_correct: Sequence[bool]) -> tuple[int, int, float]:
    """Exact McNemar test of two systems' per-question correctness: ``(only_a, only_b, two-sided p)``, where
    ``only_a`` counts questions a got right and b wrong; p is the binomial test of ``only_a`` in
    ``only_a + only_b`` trials at 0.5 (1.0 without discordant questions).

    Raises ValueError when the lengths differ."""
    from scipy.stats import binomtest

    a, b = np.asarray(a_correct, bool), np.asarray(b_correct, bool)
    if a.shape != b.shape:
        raise ValueError(f"a_correct has {a.size} questions and b_correct {b.size}; they must be paired")
    only_a, only_b = int(np.sum(a & ~b)), int(np.sum(~a & b))
    return only_a, only_b, (binomtest(only_a, only_a + only_b).pvalue if only_a + only_b else 1.0)


def paired_difference(x: Sequence[float], y: Sequence[float]) -> dict[str, float]:
    """Mean of ``x - y`` over paired samples with its 95% t interval and the two-sided Wilcoxon signed-rank p
    (scipy; 1.0 when every difference is 0). Returns ``{"mean", "ci_low", "ci_high", "p", "n"}``.

    Raises ValueError when the lengths differ or fewer than 2 pairs are given."""
    from scipy import stats

    d = np.asarray(x, np.float64) - np.asarray(y, np.float64)
    if np.shape(x) != np.shape(y) or d.size < 2:
        raise ValueError(f"x ({np.size(x)}) and y ({np.size(y)}) must be paired samples of at least 2")
    half = stats.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / np.sqrt(d.size)
    p = 1.0 if not np.any(d) else float(stats.wilcoxon(d).pvalue)
    return {"mean": float(d.mean()), "ci_low": float(d.mean() - half), "ci_high": float(d.mean() + half), "p": p,
            "n": int(d.size)}
