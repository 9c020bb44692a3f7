"""Answer and retrieval metrics, implemented once for every evaluation script and the demo.

Definitions (research note ``shared/research/retrieval_eval.md`` §2 "Shared metric definitions"):

* SQuAD normalization (SQuAD v1.1 evaluate script; identical in FlashRAG, LongBench, Lost in the
  Middle): lowercase, drop ``string.punctuation``, replace the words a/an/the by a space, collapse
  whitespace.
* ``exact_match`` / ``f1_score`` (token F1): SQuAD, maximum over the gold answers.
* Empty-gold fallback (ours, not in the SQuAD script): when normalization empties a gold answer (an
  answer that is only an article or punctuation, e.g. "A" or "?"), that gold answer and the prediction
  are compared lowercased with whitespace collapsed only (``light_normalize``). The SQuAD script would
  compare "" with "" and score any prediction that normalizes to "" as correct (and best-subspan EM
  would find "" in every prediction); best-subspan EM then needs the gold as whole tokens of the prediction.
* ``best_subspan_em``: a normalized gold answer is a substring of the normalized prediction (Lost in
  the Middle, ``src/lost_in_the_middle/metrics.py``).
* ``phantom_set_metrics``: PhantomWiki's score (``phantom_eval/score.py``): split prediction and gold
  on ``","``, strip, lowercase, compare as sets — exact match, precision, recall, F1. No punctuation
  or article stripping.
* ``recall_at_k`` / ``hit_at_k``: id-based retrieval metrics over ranked lists (``recall_per_query``: the
  per-query terms; ``recall_of_scores``: recall@k of a score matrix's ranking).

All scores are Python floats in [0, 1].
"""
from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Collection, Sequence

import numpy as np

__all__ = [
    "normalize_answer", "light_normalize", "exact_match", "f1_score", "best_subspan_em", "normalize_set",
    "phantom_set_metrics", "recall_at_k", "recall_per_query", "recall_of_scores", "hit_at_k",
]

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """SQuAD normalization: lowercase, strip punctuation, replace articles by spaces, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def light_normalize(s: str) -> str:
    """Lowercase and collapse whitespace only: the comparison used when ``normalize_answer`` empties a gold."""
    return " ".join(s.lower().split())


def _pairs(prediction: str, golds: str | Sequence[str]) -> list[tuple[str, str, bool]]:
    """(prediction, gold, fallback) per gold answer: both SQuAD-normalized, or both ``light_normalize``d
    (fallback True) when the gold normalizes to "" (module docstring, empty-gold fallback)."""
    _check_pred(prediction)
    p = normalize_answer(prediction)
    out = []
    for g in _golds(golds):
        ng = normalize_answer(g)
        fallback = not ng and bool(g.strip())
        out.append((light_normalize(prediction), light_normalize(g), True) if fallback else (p, ng, False))
    return out


def _golds(golds: str | Sequence[str]) -> list[str]:
    if isinstance(golds, str):
        return [golds]
    golds = list(golds)
    if not golds:
        raise ValueError("golds is empty; give at least one gold answer")
    if not all(isinstance(g, str) for g in golds):
        raise TypeError(f"golds must be str or a sequence of str, got {golds!r}")
    return golds


def _check_pred(prediction: str) -> None:
    if not isinstance(prediction, str):
        raise TypeError(f"prediction must be str, got {type(prediction).__name__} {prediction!r}")


def exact_match(prediction: str, golds: str | Sequence[str]) -> float:
    """1.0 when the normalized prediction equals some normalized gold answer, else 0.0.

    Raises TypeError / ValueError for a non-str prediction or an empty gold list.
    """
    return float(any(p == g for p, g, _ in _pairs(prediction, golds)))


def _token_f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:  # SQuAD v2 convention: both empty scores 1
        return float(pred_tokens == gold_tokens)
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golds: str | Sequence[str]) -> float:
    """SQuAD token F1 over normalized whitespace tokens (bag of tokens), maximum over gold answers."""
    return max(_token_f1(p.split(), g.split()) for p, g, _ in _pairs(prediction, golds))


def best_subspan_em(prediction: str, golds: str | Sequence[str]) -> float:
    """1.0 when some normalized gold answer is a substring of the normalized prediction (Lost in the Middle)."""
    # fallback golds ("a", "?") must match whole tokens: "a" is not a hit inside "paris"
    return float(any((f" {g} " in f" {p} ") if fallback else g in p for p, g, fallback in _pairs(prediction, golds)))


def normalize_set(answer: str | Sequence[str], sep: str = ",") -> set[str]:
    """PhantomWiki's ``normalize_pred``: split on ``sep``, strip, lowercase, as a set.

    A list is joined with ``sep`` first, so ``[]`` and ``""`` both give ``{""}`` (as the reference does).
    """
    if not isinstance(answer, str):
        answer = sep.join(answer)
    return {part.strip().lower() for part in answer.split(sep)}


def phantom_set_metrics(prediction: str | Sequence[str], gold: str | Sequence[str],
                        sep: str = ",") -> dict[str, float]:
    """PhantomWiki set scores of one answer.

    Args:
      prediction: model output ``"A, B"`` or a list of answers.
      gold: the gold answer list (``questions.json`` ``"answer"``) or a ``sep``-joined string.

    Returns:
      ``{"em", "precision", "recall", "f1"}``: set equality; |pred ∩ gold| / |pred|;
      |pred ∩ gold| / |gold|; their harmonic mean (0 when both are 0).
    """
    p, g = normalize_set(prediction, sep), normalize_set(gold, sep)
    common = len(p & g)
    precision, recall = common / len(p), common / len(g)
    f1 = 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)
    return {"em": float(p == g), "precision": precision, "recall": recall, "f1": f1}


def _found_per_query(retrieved: Sequence[Sequence], gold: Sequence[Collection], k: int) -> list[tuple[int, int]]:
    """(gold ids in the top k, gold ids) per query, after checking the arguments."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} must be an int >= 1")
    if len(retrieved) != len(gold):
        raise ValueError(f"retrieved has {len(retrieved)} queries but gold has {len(gold)}; they must match")
    out = []
    for i, (ranked, relevant) in enumerate(zip(retrieved, gold)):
        relevant = set(relevant)
        if not relevant:
            raise ValueError(f"gold[{i}] is empty; every query needs at least one relevant id")
        out.append((len(relevant & set(list(ranked)[:k])), len(relevant)))
    return out


def recall_at_k(retrieved: Sequence[Sequence], gold: Sequence[Collection], k: int) -> float:
    """Mean over queries of |top-k ∩ gold| / |gold|: the fraction of gold documents retrieved.

    Args:
      retrieved: per query, document ids ranked best first (e.g. the ``ids [q, k]`` of
        ``Index.search``; -1 padding never matches a gold id).
      gold: per query, the non-empty collection of relevant ids (PhantomWiki ``titles``).
      k: cut-off, >= 1; lists shorter than k are used whole.

    Returns 0.0 for zero queries.

    Raises:
      ValueError: k < 1, different numbers of queries, or an empty gold set.
    """
    per_query = recall_per_query(retrieved, gold, k)
    return sum(per_query) / len(per_query) if per_query else 0.0


def recall_per_query(retrieved: Sequence[Sequence], gold: Sequence[Collection], k: int) -> list[float]:
    """|top-k ∩ gold| / |gold| of each query (the terms :func:`recall_at_k` averages; for a standard error).

    Same arguments and errors as :func:`recall_at_k`.
    """
    return [f / n for f, n in _found_per_query(retrieved, gold, k)]


def recall_of_scores(scores, gold: Sequence[int], ks: Sequence[int]) -> dict[int, float]:
    """``{k: recall@k}`` of ranking each row of ``scores [queries, documents]`` best first (ties: lower id
    first), one gold document id per query.

    Raises:
      ValueError: as :func:`recall_at_k` (a k < 1, a query count differing from ``len(gold)``).
    """
    if not ks or min(ks) < 1:
        raise ValueError(f"ks={ks!r} must be a non-empty list of ints >= 1")
    order = np.argsort(-np.asarray(scores), axis=1, kind="stable")[:, :max(ks)]
    return {k: recall_at_k(order, [[g] for g in gold], k) for k in ks}


def hit_at_k(retrieved: Sequence[Sequence], gold: Sequence[Collection], k: int) -> float:
    """Mean over queries of 1[any gold id in the top k] (FlashRAG's ``retrieval_recall_top{k}`` on ids).

    Same arguments and errors as :func:`recall_at_k`; equal to it when each query has one gold id.
    """
    found = _found_per_query(retrieved, gold, k)
    return sum(f > 0 for f, _ in found) / len(found) if found else 0.0
