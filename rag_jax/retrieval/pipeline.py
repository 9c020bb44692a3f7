"""One retrieval pipeline: a query embedder over a vector index, and the corpus its ids point into.

``Retriever.from_texts`` embeds documents into a fresh index (``rag-jax demo``, the RAG evaluations);
``Retriever.load`` opens an output folder of ``rag-jax index`` (``rag-jax search``, ``rag_jax.retrieval.cli``).
Both search the same way: ``search_ids(queries, k)`` -> ``(scores [q, k], ids [q, k])`` and, with a corpus,
``search(questions, k)`` -> hit dicts.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from rag_jax.model.embedding import GritEmbedder
from rag_jax.model.load import load_model
from rag_jax.retrieval.corpus import Corpus
from rag_jax.retrieval.embedders import BertEmbedder
from rag_jax.retrieval.exact import ExactIndex
from rag_jax.retrieval.index import Index
from rag_jax.retrieval.scann_index import ScannIndex
from rag_jax.retrieval.storage import read_manifest
from rag_jax.tokenizer import load_tokenizer

FORMAT = "rag_jax.retrieval_build"  # the manifest format of an index output folder
EMBEDDERS = ("minilm", "bert", "grit")
INDEXES = {"exact": ExactIndex, "scann": ScannIndex}

Embed = Callable[[list[str]], np.ndarray]  # texts -> float32 [n, dim]


def make_embedders(ecfg: dict):
    """-> (document embedder, query embedder) from the ``embedder`` config section (``rag_jax.retrieval.cli``).

    Raises:
      ValueError: ``grit`` without ``path``, or a checkpoint without a tokenizer and no ``tokenizer`` given.
    """
    if ecfg["type"] in ("minilm", "bert"):
        emb = BertEmbedder(ecfg["path"], max_length=ecfg["max_length"], batch_size=ecfg["batch_size"])
        return emb, emb
    if not ecfg["path"]:
        raise ValueError("embedder.type=grit needs embedder.path (HF checkpoint folder, .gguf file or embedded model "
                         "name) and embedder.tokenizer unless the checkpoint has one")
    loaded = load_model(ecfg["path"])
    model = loaded.model
    tok = load_tokenizer(ecfg["tokenizer"]) if ecfg["tokenizer"] else loaded.tokenizer
    if tok is None:
        raise ValueError(f"embedder.path={ecfg['path']!r} has no tokenizer; set embedder.tokenizer")
    kwargs = {"batch_size": ecfg["batch_size"]}
    if ecfg["max_length"]:
        kwargs["max_length"] = ecfg["max_length"]
    docs = GritEmbedder(model, tok, instruction="", **kwargs)  # GRIT: documents get no instruction (§2)
    return docs, _Instructed(docs, ecfg["query_instruction"])


class _Instructed:
    """The same GRIT embedder (one compiled model) with the query instruction, as an ``Embedder``."""

    def __init__(self, base, instruction: str):
        self.base, self.instruction, self.dim = base, instruction, base.dim
        self.tokenizer = base.tokenizer

    def embed(self, texts):
        return self.base.embed(texts, instruction=self.instruction)


class Retriever:
    """Questions in, ranked documents out.

    Args:
      index: the vector index (``ExactIndex``, ``ScannIndex``, ...) whose ids are corpus positions.
      embed_queries: ``texts -> float32 [n, dim]`` unit-norm query vectors.
      corpus: what the ids point into (``search`` needs it; ``search_ids`` does not).
      config: the resolved build config of a loaded folder ({} otherwise).
    """

    def __init__(self, index: Index, embed_queries: Embed, corpus: Corpus | None = None, config: dict | None = None):
        self.index, self.embed_queries, self.corpus, self.config = index, embed_queries, corpus, config or {}

    @classmethod
    def from_texts(cls, docs: Sequence[str], embed_docs: Embed, embed_queries: Embed,
                   make_index: Callable[[int], Index]) -> "Retriever":
        """Embed ``docs`` (ids ``0..len(docs)-1``) into ``make_index(dim)`` and build it."""
        vectors = embed_docs(list(docs))
        index = make_index(vectors.shape[1])
        index.add(vectors, np.arange(len(docs)))
        if hasattr(index, "build"):
            index.build()
        return cls(index, embed_queries)

    @classmethod
    def load(cls, path: str | Path) -> "Retriever":
        """An output folder of ``rag-jax index`` (``rag_jax.retrieval.cli.build``): its corpus, index and query
        embedder. Raises FileNotFoundError / ValueError for a missing or foreign folder."""
        path = Path(path)
        config = read_manifest(path, FORMAT, verify=False)["config"]
        corpus = Corpus.load(path / "corpus")
        index = INDEXES[config["index"]["type"]].load(path / "index")
        _, embedder = make_embedders(config["embedder"])
        return cls(index, embedder.embed, corpus, config)

    def search_ids(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(scores float32 [q, k], ids int64 [q, k])`` best first; -1 ids pad a short result."""
        return self.index.search(self.embed_queries(list(queries)), k)

    def search(self, questions: Sequence[str], k: int = 5) -> list[list[dict]]:
        """Per question, its hits ``{"chunk", "score", "doc_id", "title", "text"}`` best first.

        Raises ValueError when the retriever has no corpus."""
        if self.corpus is None:
            raise ValueError("this Retriever has no corpus to return hits from; use search_ids")
        scores, ids = self.search_ids(questions, k)
        hits = []
        for row_scores, row_ids in zip(scores, ids):
            row = []
            for s, i in zip(row_scores, row_ids):
                if i >= 0:
                    c = self.corpus.chunk(int(i))
                    row.append({"chunk": int(i), "score": float(s), "doc_id": c.doc_id, "title": c.title,
                                "text": c.text})
            hits.append(row)
        return hits
