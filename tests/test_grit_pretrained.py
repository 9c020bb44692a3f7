"""Helpers of ``rag-jax eval grit_pretrained``: the NQ split (no gold passage shared between held-out and training
questions), base-model hard negatives and recall@k vs brute-force references."""
import numpy as np
import pytest

from rag_jax.data.loaders import NQExample, Passage
from rag_jax.recipes.grit.grit_pretrained import discordant, gold_ranks, hard_negatives, recall, split_nq
from rag_jax.evaluation.rag import complete_replies, memo_json


def _examples(n=60, passages=25, seed=0):
    rng = np.random.default_rng(seed)
    gold = rng.integers(0, passages, n)  # several questions share a gold passage
    return [NQExample(f"q{i}", (f"a{i}",), (Passage(f"t{g}", f"text {g}", True, True),)) for i, g in enumerate(gold)]


def test_split_disjoint_gold_passages_and_corpus():
    ex = _examples()
    s = split_nq(ex, eval_questions=10, train_questions=20, pool=18, seed=3)
    held_gold = {s.gold[i] for i in s.heldout}
    assert len(s.heldout) == 10 and not set(s.heldout) & set(s.train)
    assert all(s.gold[i] not in held_gold for i in s.train)
    assert len(s.corpus) == len(set(s.corpus)) == 18 and held_gold <= set(s.corpus)
    assert s.corpus[:len(held_gold)] == list(dict.fromkeys(s.gold[i] for i in s.heldout))
    assert [s.texts[s.gold[i]] for i in s.heldout] == [f"t{ex[i].gold.text[5:]}\n{ex[i].gold.text}" for i in s.heldout]
    assert split_nq(ex, eval_questions=10, train_questions=20, pool=18, seed=3) == s  # seeded
    with pytest.raises(ValueError, match="pool=3"):
        split_nq(ex, eval_questions=10, train_questions=20, pool=3, seed=3)


def test_hard_negatives_and_recall_vs_brute_force():
    rng = np.random.default_rng(4)
    scores = rng.standard_normal((7, 12))
    gold = rng.integers(0, 12, 7).tolist()
    excluded = [set(rng.choice(12, 3, replace=False).tolist()) for _ in range(7)]
    got = hard_negatives(scores, gold, excluded, 4)
    for i in range(7):
        ref = [j for j in sorted(range(12), key=lambda j: -scores[i, j]) if j != gold[i] and j not in excluded[i]][:4]
        assert got[i] == ref
    with pytest.raises(ValueError, match="only"):
        hard_negatives(scores, gold, [set(range(12)) - {0}] * 7, 1)
    r = recall(scores, gold, ks=(1, 3))
    rank = [int((scores[i] > scores[i, gold[i]]).sum()) for i in range(7)]
    assert r == {"recall@1": np.mean([x < 1 for x in rank]), "recall@3": np.mean([x < 3 for x in rank])}
    assert gold_ranks(scores, gold) == rank


def test_discordant_pairs_and_exact_mcnemar():
    a, b = [0, 7, 2, 9, 1, 6], [8, 0, 3, 9, 6, 5]   # hit@5: a hits questions 0, 2, 4; b hits 1, 2
    only_a, only_b, p = discordant(a, b, 5)
    assert (only_a, only_b) == (2, 1)
    assert p == pytest.approx(1.0)  # binomial(3, 1/2): P(X <= 1) + P(X >= 2) = 1
    assert discordant(a, a, 5) == (0, 0, 1.0)
    _, _, p = discordant([0] * 10, [9] * 10, 5)
    assert p == pytest.approx(2 * 0.5 ** 10)


def test_complete_replies_by_token_count():
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    assert complete_replies(tok, ["a b", "a b a", "a", "b b b b"], 3) == [True, False, True, False]


def test_memo_json_computes_each_key_once(tmp_path):
    calls = []

    def compute(todo):
        calls.append(list(todo))
        return [k.upper() * 2 for k in todo]
    path = tmp_path / "sub" / "memo.json"
    assert memo_json(path, ["a", "b", "a"], compute) == ["AA", "BB", "AA"]
    assert memo_json(path, ["c", "b"], compute) == ["CC", "BB"]
    assert calls == [["a", "b"], ["c"]]
    assert memo_json(None, ["x"], compute) == ["XX"]


def test_memo_json_chunks_keep_what_finished_before_a_failure(tmp_path):
    import random
    n, chunk = random.randint(5, 12), random.randint(2, 4)
    keys = [f"k{i}" for i in range(n)]
    path, calls = tmp_path / "memo.json", []

    def failing(todo):
        calls.append(list(todo))
        if len(calls) == 2:
            raise RuntimeError("killed")
        return [k + "!" for k in todo]
    with pytest.raises(RuntimeError):
        memo_json(path, keys, failing, chunk=chunk)
    assert calls == [keys[:chunk], keys[chunk:2 * chunk]]
    calls.clear()
    assert memo_json(path, keys, lambda todo: calls.append(list(todo)) or [k + "?" for k in todo], chunk=chunk) == \
        [k + "!" for k in keys[:chunk]] + [k + "?" for k in keys[chunk:]]
    assert calls == [keys[i:i + chunk] for i in range(chunk, n, chunk)]
    with pytest.raises(ValueError, match="chunk=0"):
        memo_json(path, keys, failing, chunk=0)
