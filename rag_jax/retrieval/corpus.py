"""Corpus store: documents (id, title, text), their chunks, and the chunk -> document mapping.

Chunking is either one chunk per document or token windows of ``chunk_tokens`` tokens overlapping by
``overlap`` tokens, counted by a ``tokenizers.Tokenizer`` (use the embedder's tokenizer so a window
plus the title fits its ``max_length``). A chunk keeps the exact character span of its window in
the document (``start``/``end`` offsets from the tokenizer), so chunk text is original text, not
detokenized ids. Chunk ``i`` has id ``i``: the index ids of its embedding.

On disk (``save``/``load``, atomic + verified, storage.py): ``documents.jsonl`` (``{"id", "title",
"text"}``) and ``chunks.jsonl`` (``{"doc", "start", "end"}``: document row and character span).
``Chunk.contents`` is ``"{title}\\n{text}"`` — the FlashRAG corpus convention (research note
retrieval_eval.md §2) — and is what gets embedded.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Iterable

import tokenizers

from rag_jax.retrieval.storage import atomic_directory, read_manifest

FORMAT = "rag_jax.corpus"


@dataclasses.dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str


@dataclasses.dataclass(frozen=True)
class Chunk:
    id: int          # chunk id = index id
    doc: int         # row of the document in Corpus.documents
    doc_id: str
    title: str
    text: str
    start: int       # character span [start, end) in the document text
    end: int

    @property
    def contents(self) -> str:
        return f"{self.title}\n{self.text}" if self.title else self.text


def _window_spans(text: str, tokenizer, chunk_tokens: int, overlap: int) -> list[tuple[int, int]]:
    offsets = [o for o in tokenizer.encode(text, add_special_tokens=False).offsets if o[1] > o[0]]
    if not offsets:
        return [(0, len(text))]
    stride = chunk_tokens - overlap
    spans = []
    for start in range(0, len(offsets), stride):
        window = offsets[start:start + chunk_tokens]
        spans.append((window[0][0], window[-1][1]))
        if start + chunk_tokens >= len(offsets):
            break
    return spans


class Corpus:
    """Documents and chunks. Build with ``from_documents``; persist with ``save``/``load``."""

    def __init__(self, documents: list[Document], spans: list[tuple[int, int, int]]):
        self.documents = documents
        self._spans = spans  # (doc row, start, end) per chunk

    def __len__(self) -> int:
        """Number of chunks."""
        return len(self._spans)

    def chunk(self, i: int) -> Chunk:
        doc_row, start, end = self._spans[i]
        doc = self.documents[doc_row]
        return Chunk(i, doc_row, doc.id, doc.title, doc.text[start:end], start, end)

    @property
    def chunks(self) -> list[Chunk]:
        return [self.chunk(i) for i in range(len(self))]

    def doc_of_chunk(self, chunk_ids: Iterable[int]) -> list[int]:
        """Document rows of chunk ids (-1 stays -1, for padded search results)."""
        return [self._spans[int(i)][0] if i >= 0 else -1 for i in chunk_ids]

    @classmethod
    def from_documents(cls, documents: Iterable[Document | dict], *, chunk_tokens: int | None = None,
                       overlap: int = 0, tokenizer=None) -> "Corpus":
        """Build a corpus.

        Args:
          documents: ``Document`` or dicts with ``text`` and optional ``id`` (default: the row number) and
            ``title``.
          chunk_tokens: window size in tokens; None = one chunk per document.
          overlap: tokens shared by consecutive windows, ``0 <= overlap < chunk_tokens``.
          tokenizer: ``tokenizers.Tokenizer`` counting the tokens (needed with ``chunk_tokens``).

        Raises:
          ValueError: no documents (empty corpus), a document with empty text or a duplicate id, bad
            chunking arguments. TypeError: a field of the wrong type.
        """
        docs = []
        for row, d in enumerate(documents):
            if isinstance(d, dict):
                d = Document(id=str(d.get("id", row)), title=d.get("title", "") or "", text=d.get("text"))
            if not isinstance(d, Document):
                raise TypeError(f"documents[{row}] is {type(d).__name__}; expected Document or dict")
            if not isinstance(d.text, str) or not isinstance(d.title, str):
                raise TypeError(f"documents[{row}] (id {d.id!r}): title and text must be strings")
            if not d.text.strip():
                raise ValueError(f"documents[{row}] (id {d.id!r}) has empty text; drop it or fill it")
            docs.append(d)
        if not docs:
            raise ValueError("empty corpus: no documents given")
        seen = set()
        for d in docs:
            if d.id in seen:
                raise ValueError(f"duplicate document id {d.id!r}; ids must be unique")
            seen.add(d.id)
        if chunk_tokens is None:
            spans = [(row, 0, len(d.text)) for row, d in enumerate(docs)]
        else:
            if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
                raise ValueError(f"chunk_tokens={chunk_tokens!r} must be a positive int or None (one chunk per doc)")
            if not isinstance(overlap, int) or not 0 <= overlap < chunk_tokens:
                raise ValueError(f"overlap={overlap!r} must be an int in [0, chunk_tokens={chunk_tokens})")
            if tokenizer is None:
                raise ValueError("chunk_tokens needs a tokenizer (tokenizers.Tokenizer) to count tokens")
            # A private copy without truncation/padding: a tokenizer.json may truncate (MiniLM's: 128 tokens).
            tokenizer = tokenizers.Tokenizer.from_str(tokenizer.to_str())
            tokenizer.no_truncation()
            tokenizer.no_padding()
            spans = [(row, s, e) for row, d in enumerate(docs)
                     for s, e in _window_spans(d.text, tokenizer, chunk_tokens, overlap)]
        return cls(docs, spans)

    @classmethod
    def read_documents(cls, path: str | os.PathLike, *, id_field: str | None = "id", title_field: str | None = "title",
                       text_field: str = "text") -> list[Document]:
        """Documents from a JSONL file (one object per line) or a JSON list (e.g. PhantomWiki articles.json).

        Missing ``id_field`` -> row number; missing ``title_field`` -> "". Raises FileNotFoundError, or
        ValueError naming the line/row with bad JSON or no ``text_field``.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"corpus file {path} not found")
        try:
            if path.suffix == ".json":
                try:
                    rows = json.loads(path.read_text(encoding="utf-8"))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: invalid JSON ({e})") from None
                if not isinstance(rows, list):
                    raise ValueError(f"{path}: a .json corpus must hold a list of objects, not "
                                     f"{type(rows).__name__}")
            else:
                rows = []
                with open(path, encoding="utf-8") as f:
                    for line_no, line in enumerate(f, 1):
                        if line.strip():
                            try:
                                rows.append(json.loads(line))
                            except json.JSONDecodeError as e:
                                raise ValueError(f"{path}:{line_no}: invalid JSON ({e})") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); a corpus is .jsonl or "
                             ".json text") from None
        if not rows:
            raise ValueError(f"{path}: no documents (empty corpus file)")
        docs = []
        for row, r in enumerate(rows):
            if not isinstance(r, dict) or text_field not in r:
                raise ValueError(f"{path}: record {row} has no {text_field!r} field (fields: "
                                 f"{sorted(r) if isinstance(r, dict) else type(r).__name__})")
            if not isinstance(r[text_field], str):
                raise ValueError(f"{path}: record {row} field {text_field!r} must be a string, got "
                                 f"{type(r[text_field]).__name__} {r[text_field]!r:.40}")
            docs.append(Document(id=str(r[id_field]) if id_field and id_field in r else str(row),
                                 title=str(r.get(title_field, "") or "") if title_field else "", text=r[text_field]))
        return docs

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> None:
        """Write ``documents.jsonl`` + ``chunks.jsonl`` + manifest atomically (``storage.atomic_directory``:
        an earlier corpus at ``path`` is replaced; foreign files or another artifact are refused)."""
        meta = {"documents": len(self.documents), "chunks": len(self)}
        with atomic_directory(path, FORMAT, meta, overwrite=overwrite) as tmp:
            with open(tmp / "documents.jsonl", "w") as f:
                for d in self.documents:
                    f.write(json.dumps(dataclasses.asdict(d), ensure_ascii=False) + "\n")
            with open(tmp / "chunks.jsonl", "w") as f:
                for doc, start, end in self._spans:
                    f.write(json.dumps({"doc": doc, "start": start, "end": end}) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Corpus":
        """Raises FileNotFoundError (no directory) or ValueError (corrupt / other format)."""
        path = Path(path)
        meta = read_manifest(path, FORMAT)
        try:
            with open(path / "documents.jsonl") as f:
                docs = [Document(**json.loads(line)) for line in f]
            with open(path / "chunks.jsonl") as f:
                spans = [(c["doc"], c["start"], c["end"]) for c in map(json.loads, f)]
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            raise ValueError(f"corrupt corpus directory {path}: {e}") from None
        if len(docs) != meta["documents"] or len(spans) != meta["chunks"]:
            raise ValueError(f"corrupt corpus directory {path}: counts differ from the manifest")
        return cls(docs, spans)
