"""The computation allocation model of inference scaling for RAG (Yue et al., ICLR 2025, §5) and the best
configuration per budget.

A configuration is ``θ = (k, m, n)``: retrieved documents, in-context demonstrations, generation steps (1 = DRAG,
more = IterDRAG). Its budget is the effective context length: all input tokens over all model calls (§3). The
model is

    σ⁻¹(P(θ)) ≈ (a + b ⊙ i)ᵀ log θ + c,

with ``P`` the accuracy, σ the sigmoid and ``i`` the informativeness of documents and demonstrations, measured
per dataset as the accuracy gained over the zero-shot prompt (k = m = 0, n = 1) by one document and by one
demonstration (§5.1; the third entry, for steps, is 0). Zero documents or demonstrations are allowed here, so
``log θ`` is ``(log(1 + k), log(1 + m), log n)`` (the paper's grid starts at 1). With one dataset ``i`` is a
constant and ``b`` cannot be told from ``a``: its columns are fitted only when the datasets' ``i`` differ.
Accuracies are clipped to ``[1/(2N), 1 - 1/(2N)]`` for N questions before the logit, so 0 and 1 stay finite.
Fit: least squares (minimum norm where columns are collinear).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


def log_theta(k, m, n) -> np.ndarray:
    """float64 ``[c, 3]``: ``(log(1 + k), log(1 + m), log n)`` per configuration. Raises ValueError for k or m
    below 0 or n below 1."""
    k, m, n = (np.asarray(x, np.float64).reshape(-1) for x in (k, m, n))
    if (k < 0).any() or (m < 0).any() or (n < 1).any():
        raise ValueError(f"configurations need k >= 0, m >= 0, n >= 1; got k={k.tolist()}, m={m.tolist()}, "
                         f"n={n.tolist()}")
    return np.stack([np.log1p(k), np.log1p(m), np.log(n)], axis=1)


def clipped_logit(p, num_questions: int) -> np.ndarray:
    eps = 1.0 / (2 * num_questions)
    p = np.clip(np.asarray(p, np.float64), eps, 1 - eps)
    return np.log(p) - np.log1p(-p)


@dataclasses.dataclass(frozen=True)
class AllocationModel:
    """Fitted coefficients: ``a`` [3], ``b`` [3] (zeros when not fitted), ``c``."""

    a: np.ndarray
    b: np.ndarray
    c: float

    @classmethod
    def fit(cls, k, m, n, accuracy, num_questions: int, informativeness=None) -> AllocationModel:
        """Fit on configurations ``(k[j], m[j], n[j])`` with measured ``accuracy[j]`` over ``num_questions``;
        ``informativeness``: ``[c, 3]`` per configuration (its dataset's ``i``), None for one dataset.
        Raises ValueError for fewer configurations than coefficients."""
        x = log_theta(k, m, n)
        i = np.zeros_like(x) if informativeness is None else np.asarray(informativeness, np.float64)
        with_b = len({tuple(r) for r in np.round(i, 12)}) > 1
        cols = [x, i * x] if with_b else [x]
        design = np.concatenate([*cols, np.ones((len(x), 1))], axis=1)
        if len(x) < design.shape[1]:
            raise ValueError(f"{len(x)} configurations cannot fit {design.shape[1]} coefficients")
        coef, *_ = np.linalg.lstsq(design, clipped_logit(accuracy, num_questions), rcond=None)
        return cls(coef[:3], coef[3:6] if with_b else np.zeros(3), float(coef[-1]))

    def predict(self, k, m, n, informativeness=None) -> np.ndarray:
        """Predicted accuracy float64 ``[c]``."""
        x = log_theta(k, m, n)
        i = np.zeros_like(x) if informativeness is None else np.asarray(informativeness, np.float64)
        z = x @ self.a + (i * x) @ self.b + self.c
        return 1.0 / (1.0 + np.exp(-z))


def informativeness(acc: dict[tuple[int, int, int], float]) -> np.ndarray:
    """``i = (P(1,0,1) - P(0,0,1), P(0,1,1) - P(0,0,1), 0)`` from a dataset's accuracies keyed by ``(k, m, n)``.
    Raises KeyError naming a configuration the grid lacks."""
    for key in ((0, 0, 1), (1, 0, 1), (0, 1, 1)):
        if key not in acc:
            raise KeyError(f"informativeness needs configuration (k, m, n) = {key} in the grid")
    base = acc[(0, 0, 1)]
    return np.array([acc[(1, 0, 1)] - base, acc[(0, 1, 1)] - base, 0.0])


def leave_one_out(k, m, n, accuracy, num_questions: int, informativeness=None) -> np.ndarray:
    """Each configuration's accuracy predicted by the model fitted on all the others, float64 ``[c]``."""
    k, m, n, accuracy = (np.asarray(v) for v in (k, m, n, accuracy))
    i = None if informativeness is None else np.asarray(informativeness, np.float64)
    out = np.empty(len(k))
    for j in range(len(k)):
        keep = np.arange(len(k)) != j
        model = AllocationModel.fit(k[keep], m[keep], n[keep], accuracy[keep], num_questions,
                                    None if i is None else i[keep])
        out[j] = model.predict(k[j:j + 1], m[j:j + 1], n[j:j + 1], None if i is None else i[j:j + 1])[0]
    return out


def best_under_budget(lengths: Sequence[float], scores: Sequence[float], budget: float,
                      allowed: Sequence[bool] | None = None) -> int | None:
    """Index of the highest score among configurations with ``lengths <= budget`` (and ``allowed``), the shorter
    one on ties; None when none fits."""
    best = None
    for j, (length, s) in enumerate(zip(lengths, scores)):
        if length <= budget and (allowed is None or allowed[j]):
            if best is None or (s, -length) > (scores[best], -lengths[best]):
                best = j
    return best


def slope_per_doubling(budgets: Sequence[float], accuracy: Sequence[float]) -> float:
    """Least-squares slope of ``accuracy`` against ``log2(budget)``: accuracy gained per doubling of the budget
    (the paper's "almost linear in the log of the budget"). nan for fewer than 2 budgets."""
    if len(budgets) < 2:
        return float("nan")
    return float(np.polyfit(np.log2(np.asarray(budgets, np.float64)), np.asarray(accuracy, np.float64), 1)[0])
