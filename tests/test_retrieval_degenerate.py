"""Degenerate corpora for every vector retriever (exact, ScaNN; BM25's are in test_retrieval_lexical.py): an empty
index gives a one-line error naming what to do, one document and repeated documents give the exact answer
(float64 NumPy inner products as the reference), ``-1`` / ``-inf`` past the corpus."""
import numpy as np
import pytest

from rag_jax.retrieval.exact import ExactIndex
from rag_jax.retrieval.scann_index import ScannIndex

INDEXES = {"exact": ExactIndex, "scann": ScannIndex}


def _unit(rng, n, d):
    x = rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("kind", sorted(INDEXES))
def test_empty_index_search_is_a_clear_error(kind):
    index = INDEXES[kind](8)
    with pytest.raises(ValueError, match="empty") as err:
        index.search(_unit(np.random.default_rng(), 2, 8), 3)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", sorted(INDEXES))
def test_one_document(kind):
    rng = np.random.default_rng()
    index = INDEXES[kind](16)
    doc, queries = _unit(rng, 1, 16), _unit(rng, 4, 16)
    index.add(doc, [int(rng.integers(1 << 40))])
    scores, ids = index.search(queries, 3)
    np.testing.assert_allclose(scores[:, 0], (queries.astype(np.float64) @ doc[0].astype(np.float64)), atol=1e-5)
    assert (ids[:, 1:] == -1).all() and np.isneginf(scores[:, 1:]).all()


@pytest.mark.parametrize("kind", sorted(INDEXES))
def test_duplicate_documents_are_all_returned_with_equal_scores(kind):
    rng = np.random.default_rng()
    base = _unit(rng, 5, 16)
    docs = np.concatenate([base, base[[1, 1, 3]]])                   # rows 5, 6 repeat row 1; row 7 repeats row 3
    ids = rng.choice(1 << 40, size=len(docs), replace=False)
    index = INDEXES[kind](16)
    index.add(docs, ids)
    queries = np.concatenate([base[[1]], _unit(rng, 3, 16)])
    scores, found = index.search(queries, len(docs))
    ref = queries.astype(np.float64) @ docs.astype(np.float64).T
    np.testing.assert_allclose(scores, np.sort(ref, axis=1)[:, ::-1], atol=1e-5)
    assert set(found[0, :3].tolist()) == {ids[1], ids[5], ids[6]}    # the three copies of the query's own row
    assert sorted(found[1].tolist()) == sorted(ids.tolist())
