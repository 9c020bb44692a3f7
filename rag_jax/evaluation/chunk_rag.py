"""Retrieval over one long prompt's own text (LaRA-style RAG vs long context, Li et al. ICML 2025; RAPID's drafter):
the haystack cut into sentences and lines, the ``k`` chunks a retriever ranks highest for the question kept in
their original order, and the short prompt that reads them, whole or as Block-Attention blocks.

A long-context prompt is ``(instruction, haystack, question)`` (``rag_jax.recipes.em_llm.tasks.Prompt.parts``);
the short prompt puts the chosen chunks in the haystack's place under the model's chat template, with the
same reply prefix. Retrievers: ``bm25`` (``rag_jax.retrieval.lexical``) or ``minilm`` (MiniLM-L6 embeddings,
exact dot-product search).
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from rag_jax.retrieval.embedders import BertEmbedder
from rag_jax.retrieval.lexical import BM25Index
from rag_jax.text import chat_pieces, encode_content, encode_pieces

CHUNK_RETRIEVERS = ("bm25", "minilm")


def chunks(haystack: str) -> list[str]:
    """The haystack's sentences and lines (each keeping its trailing space or newline), in order; joined they are
    the haystack."""
    return [m.group(0) for m in re.finditer(r"[^.!?\n]*[.!?\n]?[ \t\n]*", haystack) if m.group(0)]


def top_chunks(pieces: Sequence[str], query: str, k: int, retriever: str = "bm25", embed=None) -> list[int]:
    """Indices of the ``k`` pieces ``retriever`` ranks highest for ``query``, in their original order.
    ``embed``: ``texts -> float32 [n, dim]`` unit-norm for ``minilm`` (default: a new ``BertEmbedder``).
    Raises ValueError for another retriever or ``k < 1``."""
    if retriever not in CHUNK_RETRIEVERS or k < 1:
        raise ValueError(f"retriever={retriever!r}, k={k}; valid: one of {CHUNK_RETRIEVERS}, k >= 1")
    k = min(k, len(pieces))
    if retriever == "bm25":
        _, ids = BM25Index(list(pieces)).search([query], k)
        return sorted(int(i) for i in ids[0] if i >= 0)
    embed = embed or BertEmbedder().embed
    scores = embed(list(pieces)) @ embed([query])[0]
    return sorted(int(i) for i in np.argsort(-scores, kind="stable")[:k])


def rag_content(parts: tuple[str, str, str], query: str, k: int, retriever: str = "bm25", embed=None) -> str:
    """The user message with its haystack replaced by the ``k`` best chunks for ``query``, in their order."""
    pieces = chunks(parts[1])
    return parts[0] + "".join(pieces[i] for i in top_chunks(pieces, query, k, retriever, embed)) + parts[2]


def rag_blocks(loaded, parts: tuple[str, str, str], query: str, k: int, prefix: str = "", retriever: str = "bm25",
               embed=None) -> list[list[int]]:
    """The short prompt as Block-Attention blocks (Ma et al., ICLR 2025, §2.1 layout): template head +
    instruction, one block per chosen chunk, question + template tail + reply ``prefix``; chunks and question are
    content, the template markup. Raises ValueError for a model without chat template."""
    if loaded.chat_template is None:
        raise ValueError(f"model {loaded.source} has no chat template for RAG prompt blocks")
    head, _, tail = chat_pieces(loaded.chat_template, [{"role": "user", "content": "x"}], **loaded.special_tokens)
    pieces = chunks(parts[1])
    tok = loaded.tokenizer
    return [encode_pieces(tok, [head, parts[0]]).ids,
            *[encode_content(tok, pieces[i]) for i in top_chunks(pieces, query, k, retriever, embed)],
            encode_pieces(tok, [parts[2], tail, prefix]).ids]
