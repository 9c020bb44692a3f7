"""Retrieval: corpus store, embedders, the Index interface (exact and ScaNN), sharded search, CLI."""
from rag_jax.retrieval.corpus import Chunk, Corpus, Document
from rag_jax.retrieval.embedders import BertEmbedder, Embedder, embed_texts, minilm_dir
from rag_jax.retrieval.exact import ExactIndex
from rag_jax.retrieval.index import Index, VectorIndex
from rag_jax.retrieval.scann_index import ScannConfig, ScannIndex
from rag_jax.retrieval.sharded import ShardedIndex, merge_top_k, shard_slice

__all__ = ["Chunk", "Corpus", "Document", "BertEmbedder", "Embedder", "embed_texts", "minilm_dir", "ExactIndex",
           "Index", "VectorIndex", "ScannConfig", "ScannIndex", "ShardedIndex", "merge_top_k", "shard_slice"]
