"""ScaNN recall@10 vs exact on real MiniLM embeddings of NQ passages (../shared/data, skipped if absent).

Budget: embedding all 2,655 passages at 256 tokens takes minutes on 2 CPU cores, so the test embeds
the gold passages of the first NUM_QUESTIONS questions, truncated to MAX_TOKENS tokens (their
title and opening), and their questions; ``rag-jax eval retrieval_nq`` runs the full set.
"""
import numpy as np
import pytest

from rag_jax.data.loaders import load_nq_oracle, nq_passage_pool
from rag_jax.retrieval.embedders import BertEmbedder
from rag_jax.retrieval.exact import ExactIndex
from rag_jax.retrieval.scann_index import ScannConfig, ScannIndex

NUM_QUESTIONS, MAX_TOKENS = 800, 64


@pytest.fixture(scope="module")
def nq_embeddings(shared_data):
    path = shared_data / "lost_in_the_middle" / "nq-open-oracle.jsonl.gz"
    if not path.is_file():
        pytest.skip(f"{path} is absent (NQ oracle file of the shared data folder)")
    examples = load_nq_oracle(path, limit=NUM_QUESTIONS)
    pool, gold = nq_passage_pool(examples)
    emb = BertEmbedder(max_length=MAX_TOKENS, batch_size=64)
    return (emb.embed([f"{p.title}\n{p.text}" for p in pool]), emb.embed([ex.question for ex in examples]),
            np.asarray(gold))


def _recall(found, truth):
    return np.mean([len(np.intersect1d(a, b)) for a, b in zip(found, truth)]) / truth.shape[1]


def test_scann_recall_on_minilm_nq_embeddings(nq_embeddings):
    passages, questions, gold = nq_embeddings
    n = len(passages)
    ids = np.arange(n)
    exact = ExactIndex(passages.shape[1])
    exact.add(passages, ids)
    truth = exact.search(questions, 10)[1]
    # The embeddings retrieve: most questions find their own gold passage (a broken encoder would not).
    assert np.mean((truth == gold[:, None]).any(axis=1)) >= 0.9
    # Forced AH with a short re-scoring list (2k): quantization itself must keep recall@10 high.
    ah = ScannIndex(passages.shape[1], ScannConfig(mode="ah", reorder_num_neighbors=20))
    ah.add(passages, ids)
    assert _recall(ah.search(questions, 10)[1], truth) >= 0.95
    # Forced tree (>= 50 points per leaf) tuned for recall@10 >= 0.97 on passages (leave-one-out); the
    # held-out questions must get >= 0.95.
    tree = ScannIndex(passages.shape[1], ScannConfig(mode="tree_ah", num_leaves=n // 50, target_recall=0.97))
    tree.add(passages, ids)
    tree.build()
    assert tree.tuning["reached"]
    assert _recall(tree.search(questions, 10)[1], truth) >= 0.95
