"""BM25Index (rag_jax.retrieval.lexical) against a naive float64 NumPy BM25 (Lucene variant)."""
import numpy as np
import pytest

from rag_jax.retrieval.lexical import BM25Index

# words of >= 2 letters that are not English stop words, so the reference can split on spaces
WORDS = [f"w{a}{b}" for a in "abcdefgh" for b in "xyz"]


def reference_scores(docs: list[list[str]], query: list[str], k1: float, b: float) -> np.ndarray:
    n = len(docs)
    lengths = np.array([len(d) for d in docs], np.float64)
    avgdl = lengths.mean()
    out = np.zeros(n, np.float64)
    for t in query:
        tf = np.array([d.count(t) for d in docs], np.float64)
        df = float((tf > 0).sum())
        if df == 0:
            continue
        idf = np.log(1.0 + (n - df + 0.5) / (df + 0.5))
        norm = k1 * (1.0 - b + b * lengths / avgdl)        # 0 for an empty document at b = 1, where tf = 0
        out += np.where(tf > 0, idf * tf / np.where(tf > 0, tf + norm, 1.0), 0.0)
    return out


@pytest.mark.parametrize("k1,b", [(1.5, 0.75), (0.9, 0.4), (2.0, 1.0)])
def test_scores_and_ranking_match_reference(k1, b):
    rng = np.random.default_rng(int(k1 * 10 + b * 100))
    docs = [list(rng.choice(WORDS, size=rng.integers(1, 30))) for _ in range(60)]
    docs[int(rng.integers(60))] = []                                  # a document without words: length 0
    queries = [list(rng.choice(WORDS, size=rng.integers(1, 6))) for _ in range(25)]
    index = BM25Index([" ".join(d) for d in docs], k1=k1, b=b)
    k = 10
    scores, ids = index.search([" ".join(q) for q in queries], k)
    assert scores.shape == ids.shape == (len(queries), k) and ids.dtype == np.int64
    for q, s, i in zip(queries, scores, ids):
        ref = reference_scores(docs, q, k1, b)
        np.testing.assert_allclose(s, ref[i], rtol=1e-5, atol=1e-6)        # each returned score is its doc's
        np.testing.assert_allclose(s, np.sort(ref)[::-1][:k], rtol=1e-5, atol=1e-6)  # and they are the top k
        assert len(set(i.tolist())) == k


def test_text_tokens_case_stopwords_unknown_words_and_padding():
    docs = ["The friends of Ann Lee are Bob Day and Cy Ng.", "The date of birth of Bob Day is 0227-09-18.", "",
            "Bob Day likes microscopy.", "the of and"]
    index = BM25Index(docs)
    scores, ids = index.search(["Who was born on 0227-09-18?", "zzzz qqqq", "MICROSCOPY"], k=7)
    assert ids[0, 0] == 1 and scores[0, 0] > 0                      # the date's three tokens match doc 1 only
    assert np.all(scores[1, :5] == 0)                               # unknown words score nothing (not the empty doc)
    assert ids[2, 0] == 3 and scores[2, 0] > 0                      # lowercased
    assert np.all(ids[:, 5:] == -1) and np.all(np.isneginf(scores[:, 5:]))  # k > num_docs: padded
    assert index.query_tokens(["the of and"]) == [[]]               # stop words dropped


@pytest.mark.parametrize("kwargs,match", [
    (dict(docs=[]), "docs is empty"),
    (dict(docs="alpha beta"), "docs is a str"),
    (dict(docs=["a b", 3]), r"docs\[1\] is int"),
    (dict(docs=["a b"], k1=-1.0), "k1=-1.0"),
    (dict(docs=["a b"], b=1.5), "b=1.5"),
])
def test_bad_construction(kwargs, match):
    docs = kwargs.pop("docs")
    with pytest.raises(ValueError, match=match):
        BM25Index(docs, **kwargs)


def test_bad_search():
    index = BM25Index(["alpha beta", "gamma"])
    with pytest.raises(ValueError, match="k=0"):
        index.search(["alpha"], 0)
    with pytest.raises(ValueError, match="list of str"):
        index.search("alpha", 1)


@pytest.mark.parametrize("docs", [["", "   "], ["the and of", "a", "it is"], ["", "the\n\t"]])
def test_corpus_without_indexable_words_matches_nothing(docs):
    """No document has a word (empty, blank, stop words only): every query scores 0 (bm25s raised
    ``max() arg is an empty sequence`` before issue 27)."""
    scores, ids = BM25Index(docs).search(["wax wby", "the", ""], 5)
    n = len(docs)
    np.testing.assert_array_equal(scores[:, :n], 0.0)
    assert np.isneginf(scores[:, n:]).all() and (ids[:, n:] == -1).all()
    assert sorted(ids[0, :n].tolist()) == list(range(n))


def test_one_document_and_duplicate_documents_match_reference():
    rng = np.random.default_rng()
    one = [list(rng.choice(WORDS, size=rng.integers(1, 10)))]
    base = [list(rng.choice(WORDS, size=rng.integers(1, 10))) for _ in range(4)]
    dup = base + [base[1], base[1], base[3]]                          # repeated documents
    for docs in (one, dup):
        index = BM25Index([" ".join(d) for d in docs])
        queries = [list(rng.choice(WORDS, size=rng.integers(1, 5))) for _ in range(10)] + [docs[0][:1]]
        scores, ids = index.search([" ".join(q) for q in queries], len(docs))
        for q, s, i in zip(queries, scores, ids):
            ref = reference_scores(docs, q, 1.5, 0.75)
            np.testing.assert_allclose(s, ref[i], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(s, np.sort(ref)[::-1], rtol=1e-5, atol=1e-6)
