"""Metrics against hand-computed values."""
import numpy as np
import pytest

from rag_jax.metrics import (best_subspan_em, exact_match, f1_score, hit_at_k, normalize_answer, normalize_set,
                             phantom_set_metrics, recall_at_k, recall_of_scores, recall_per_query)


@pytest.mark.parametrize("text, expected", [
    ("The  Quick, brown fox!", "quick brown fox"),
    ("An apple a day", "apple day"),
    ("theater Anthem", "theater anthem"),  # articles only as whole words
    ("A.B.C. (the band)", "abc band"),
    ("  \tTHE\n", ""),
    ("Wilhelm Conrad Röntgen", "wilhelm conrad röntgen"),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match():
    assert exact_match("The Eiffel Tower.", ["eiffel tower"]) == 1.0
    assert exact_match("Eiffel Tower in Paris", "Eiffel Tower") == 0.0
    assert exact_match("1901", ["in 1901", "1901"]) == 1.0  # max over golds
    with pytest.raises(ValueError, match="golds is empty"):
        exact_match("x", [])
    with pytest.raises(TypeError, match="prediction must be str"):
        exact_match(None, "x")


def test_f1_score():
    # pred tokens [cat, sat, on, mat], gold [cat, on, mat]: same 3, P 3/4, R 1 -> 6/7
    assert f1_score("the cat sat on the mat", "a cat on a mat") == pytest.approx(6 / 7)
    # bag of tokens: red x2 vs red x1 -> same = 1 red + 1 blue = 2, P = R = 2/3
    assert f1_score("red red blue", "red blue blue") == pytest.approx(2 / 3)
    assert f1_score("nothing shared", "other words") == 0.0
    assert f1_score("the", "a") == 0.0  # gold emptied by normalization: compared unnormalized (metrics docstring)
    assert f1_score("A", "a") == 1.0
    assert f1_score("x", "the") == 0.0
    assert f1_score("Paris France", ["London", "paris"]) == pytest.approx(2 / 3)  # max: P 1/2, R 1


def test_best_subspan_em():
    pred = "I think it was Wilhelm Conrad Röntgen, in 1901."
    assert best_subspan_em(pred, ["Wilhelm Conrad Röntgen"]) == 1.0
    assert best_subspan_em("Röntgen", ["Wilhelm Conrad Röntgen"]) == 0.0
    assert best_subspan_em("the answer is 42", ["41", "42"]) == 1.0
    assert best_subspan_em("catalog", "cat") == 1.0  # substring, not token match (as in Lost in the Middle)


def test_phantom_set_metrics():
    m = phantom_set_metrics("Alice, bob ,Carol", ["alice", "Bob", "Dave"])
    assert m["em"] == 0.0 and m["precision"] == pytest.approx(2 / 3) and m["recall"] == pytest.approx(2 / 3)
    assert m["f1"] == pytest.approx(2 / 3)
    assert phantom_set_metrics("Bob, Alice, bob", ["alice", "bob"]) == {"em": 1.0, "precision": 1.0, "recall": 1.0, "f1": 1.0}
    # one of two gold answers: P 1, R 1/2, F1 2/3
    assert phantom_set_metrics(["alice"], ["alice", "bob"]) == pytest.approx(
        {"em": 0.0, "precision": 1.0, "recall": 0.5, "f1": 2 / 3})
    assert phantom_set_metrics("", ["a"]) == {"em": 0.0, "precision": 0.0, "recall": 0.0, "f1": 0.0}
    assert phantom_set_metrics("alice.", ["alice"])["em"] == 0.0  # no punctuation stripping (PhantomWiki)
    assert phantom_set_metrics(["2", "0"], "0,2")["em"] == 1.0
    assert normalize_set([]) == normalize_set("") == {""}


def test_recall_and_hit_at_k():
    retrieved = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    gold = [{2, 9}, {7}, [9]]
    # k=2: q0 finds 2 of {2, 9} -> 1/2; q1 none; q2 none -> recall 1/6, hit 1/3
    assert recall_at_k(retrieved, gold, 2) == pytest.approx(1 / 6)
    assert hit_at_k(retrieved, gold, 2) == pytest.approx(1 / 3)
    # k=3: q2 finds 9 -> (1/2 + 0 + 1) / 3
    assert recall_at_k(retrieved, gold, 3) == pytest.approx(0.5)
    assert hit_at_k(retrieved, gold, 3) == pytest.approx(2 / 3)
    assert recall_at_k(retrieved, gold, 1) == 0.0
    ids = np.array([[3, -1], [0, 2]], dtype=np.int64)  # Index.search output with -1 padding
    assert recall_at_k(ids, [[3], [2, 5]], 2) == pytest.approx(0.75)
    assert recall_at_k([["Ann Lee", "Bo Li"]], [("Bo Li",)], 5) == 1.0  # string ids, k beyond the list
    assert recall_per_query(retrieved, gold, 3) == [0.5, 0.0, 1.0]
    assert recall_at_k([], [], 3) == 0.0
    with pytest.raises(ValueError, match="k=0 must be an int >= 1"):
        recall_at_k(retrieved, gold, 0)
    with pytest.raises(ValueError, match="retrieved has 3 queries but gold has 2"):
        hit_at_k(retrieved, gold[:2], 1)
    with pytest.raises(ValueError, match=r"gold\[1\] is empty"):
        recall_at_k(retrieved, [{1}, set(), {2}], 1)


def test_recall_of_scores():
    scores = np.array([[0.1, 0.9, 0.5], [0.7, 0.7, 0.2], [0.0, 0.3, 0.1]])
    # rankings: q0 -> 1, 2, 0; q1 -> 0, 1 (tie: lower id first), 2; q2 -> 1, 2, 0
    assert recall_of_scores(scores, [2, 1, 0], ks=(1, 2, 3)) == {1: 0.0, 2: pytest.approx(2 / 3), 3: 1.0}
    with pytest.raises(ValueError, match="ks"):
        recall_of_scores(scores, [2, 1, 0], ks=())
