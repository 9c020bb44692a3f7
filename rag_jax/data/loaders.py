"""Loaders for the evaluation data in ``shared/data/`` (see ``shared/data/README.md``), as typed records.

* PhantomWiki folder (``articles.json`` + ``questions.json``; official generator or
  :meth:`rag_jax.data.phantom.Universe.save`) -> :class:`PhantomWikiData`.
* Lost in the Middle NQ-open oracle (``nq-open-oracle.jsonl.gz``) -> list of :class:`NQExample`.
* Lost in the Middle KV retrieval (``kv-retrieval-*_keys.jsonl.gz``) -> list of :class:`KVExample`.

Missing files raise FileNotFoundError and malformed ones ValueError, each naming the file, the
record and the field. Degenerate but well-formed inputs are valid: an empty or blank JSONL file and a
PhantomWiki folder with empty lists load as empty datasets (callers that need examples say so). :func:`shared_data_dir` returns None when the shared folder is absent, so
callers can skip with a reason.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from rag_jax.data.phantom import FactBase, evaluate_query

__all__ = [
    "Article", "Question", "PhantomWikiData", "Passage", "NQExample", "KVExample",
    "load_phantomwiki", "load_nq_oracle", "load_kv_retrieval", "nq_passage_pool", "shared_data_dir", "shared_file",
    "NQ_ORACLE", "heldout_split",
]


def shared_data_dir() -> Path | None:
    """``<repo>/../shared/data`` when it exists (the project workspace), else None.

    ``RAG_JAX_SHARED_DATA`` overrides the location.
    """
    env = os.environ.get("RAG_JAX_SHARED_DATA")
    path = Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "data"
    return path if path.is_dir() else None


NQ_ORACLE = ("lost_in_the_middle", "nq-open-oracle.jsonl.gz")  # shared_file(*NQ_ORACLE)


def shared_file(*parts: str) -> Path:
    """``parts`` under :func:`shared_data_dir` (under its default location when absent, so errors name it)."""
    base = shared_data_dir() or Path(__file__).resolve().parents[2].parent / "shared" / "data"
    return base.joinpath(*parts)


# ---------------------------------------------------------------------------------------------
# PhantomWiki.

@dataclasses.dataclass(frozen=True)
class Article:
    title: str
    article: str
    facts: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Question:
    """One question. ``answer`` is the full answer set; ``hops`` = query predicates (official
    ``difficulty``); ``titles`` = gold evidence article titles, None when they cannot be derived
    (no ``titles`` field and no evaluable ``prolog`` query)."""
    id: str
    question: str
    answer: tuple[str, ...]
    hops: int
    titles: tuple[str, ...] | None
    prolog: dict | None = None


@dataclasses.dataclass(frozen=True)
class PhantomWikiData:
    path: Path
    articles: tuple[Article, ...]
    questions: tuple[Question, ...]


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {path} not found")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _field(rec: Any, name: str, kind: type, where: str) -> Any:
    if not isinstance(rec, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(rec).__name__}")
    if name not in rec:
        raise ValueError(f"{where} has no field {name!r} (fields: {sorted(rec)})")
    value = rec[name]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ValueError(f"{where} field {name!r} must be {kind.__name__}, got {type(value).__name__} {value!r:.80}")
    return value


def _str_list(rec: dict, name: str, where: str) -> tuple[str, ...]:
    value = _field(rec, name, list, where)
    if not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where} field {name!r} must be a list of strings, got {value!r:.80}")
    return tuple(value)


def load_phantomwiki(folder: str | os.PathLike, derive_titles: bool = True) -> PhantomWikiData:
    """Load a PhantomWiki-format folder.

    Args:
      folder: holds ``articles.json`` (list of {title, article, facts}) and ``questions.json``
        (list of {id, question, answer, ...}; ``hops``/``titles`` when we generated it, else
        ``difficulty``/``prolog`` from the official generator).
      derive_titles: for questions without ``titles``, evaluate their ``prolog`` query over the
        article facts (:func:`rag_jax.data.phantom.evaluate_query`) to get the gold evidence.

    Raises:
      FileNotFoundError: the folder or a file is missing.
      ValueError: invalid JSON, a missing/mistyped field (named with the record index), a
        duplicate article title, or an unparsable fact.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"PhantomWiki folder {folder} not found "
                                "(expected a folder with articles.json and questions.json)")
    raw_articles = _read_json(folder / "articles.json", "PhantomWiki articles")
    raw_questions = _read_json(folder / "questions.json", "PhantomWiki questions")
    for name, raw in (("articles.json", raw_articles), ("questions.json", raw_questions)):
        if not isinstance(raw, list):
            raise ValueError(f"{folder / name} must hold a JSON list, got {type(raw).__name__}")

    articles = []
    for i, rec in enumerate(raw_articles):
        where = f"{folder / 'articles.json'} record {i}"
        articles.append(Article(_field(rec, "title", str, where), _field(rec, "article", str, where),
                                _str_list(rec, "facts", where)))
    titles_seen: set[str] = set()
    for a in articles:
        if a.title in titles_seen:
            raise ValueError(f"{folder / 'articles.json'}: duplicate article title {a.title!r}")
        titles_seen.add(a.title)

    facts: FactBase | None = None
    questions = []
    for i, rec in enumerate(raw_questions):
        where = f"{folder / 'questions.json'} record {i}"
        qid, text = _field(rec, "id", str, where), _field(rec, "question", str, where)
        answer = _str_list(rec, "answer", where)
        prolog = rec.get("prolog")
        if prolog is not None and not (isinstance(prolog, dict) and isinstance(prolog.get("query"), list)
                                       and isinstance(prolog.get("answer"), str)):
            raise ValueError(f"{where} field 'prolog' must be {{'query': [str], 'answer': str}}, got {prolog!r:.80}")
        if "hops" in rec:
            hops = _field(rec, "hops", int, where)
        elif "difficulty" in rec:
            hops = _field(rec, "difficulty", int, where)
        elif prolog is not None:
            hops = len(prolog["query"])
        else:
            raise ValueError(f"{where} has none of 'hops', 'difficulty', 'prolog' to give its hop count")
        titles: tuple[str, ...] | None = None
        if "titles" in rec:
            titles = _str_list(rec, "titles", where)
        elif derive_titles and prolog is not None:
            if facts is None:
                try:
                    facts = FactBase.from_articles(dataclasses.asdict(a) for a in articles)
                except ValueError as e:
                    raise ValueError(f"{folder / 'articles.json'}: {e}") from None
            try:
                titles = tuple(evaluate_query(facts, prolog["query"], prolog["answer"])[1])
            except ValueError:
                titles = None  # a query form we do not evaluate (e.g. a derived relation): no gold titles
        questions.append(Question(qid, text, answer, hops, titles, prolog))
    return PhantomWikiData(folder, tuple(articles), tuple(questions))


# ---------------------------------------------------------------------------------------------
# Lost in the Middle.

@dataclasses.dataclass(frozen=True)
class Passage:
    title: str
    text: str
    has_answer: bool | None = None
    is_gold: bool | None = None


@dataclasses.dataclass(frozen=True)
class NQExample:
    """An NQ-open question with its answers and passages (``ctxs``; one gold passage in the oracle file)."""
    question: str
    answers: tuple[str, ...]
    ctxs: tuple[Passage, ...]

    @property
    def gold(self) -> Passage:
        """The first passage marked ``isgold`` (the first passage when none is marked)."""
        return next((c for c in self.ctxs if c.is_gold), self.ctxs[0])


@dataclasses.dataclass(frozen=True)
class KVExample:
    """Key-value retrieval: find ``value`` of ``key`` among ``kv_records`` ([(key, value)], UUID strings)."""
    kv_records: tuple[tuple[str, str], ...]
    key: str
    value: str

    @property
    def gold_index(self) -> int:
        """Position of ``key`` in ``kv_records``."""
        return next(i for i, (k, _) in enumerate(self.kv_records) if k == self.key)


def _jsonl(path: str | os.PathLike, what: str, limit: int | None) -> Iterator[tuple[str, dict]]:
    path = Path(path)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit={limit!r} must be None or an int >= 0")
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {path} not found (see shared/data/README.md)")
    opener = gzip.open if path.suffix == ".gz" else open
    n = 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and n >= limit:
                    return
                if not line.strip():
                    continue
                where = f"{path} line {lineno}"
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where} is not valid JSON: {e}") from None
                n += 1
                yield where, rec
    except (gzip.BadGzipFile, EOFError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a readable {'gzip ' if opener is gzip.open else ''}JSONL file: {e}") from None


def load_nq_oracle(path: str | os.PathLike, limit: int | None = None) -> list[NQExample]:
    """Load ``nq-open-oracle.jsonl.gz`` (2,655 lines of {question, answers, ctxs: [{title, text, hasanswer, isgold}]}).

    Args:
      path: the ``.jsonl.gz`` (or plain ``.jsonl``) file.
      limit: read at most this many examples.

    Raises:
      FileNotFoundError; ValueError for bad gzip/JSON or a missing/mistyped field (file, line, field named).
    """
    out = []
    for where, rec in _jsonl(path, "NQ oracle", limit):
        ctxs = _field(rec, "ctxs", list, where)
        if not ctxs:
            raise ValueError(f"{where} field 'ctxs' is empty; each example needs its gold passage")
        passages = []
        for j, c in enumerate(ctxs):
            cw = f"{where} ctxs[{j}]"
            passages.append(Passage(_field(c, "title", str, cw), _field(c, "text", str, cw),
                                    c.get("hasanswer"), c.get("isgold")))
        answers = _str_list(rec, "answers", where)
        if not answers:
            raise ValueError(f"{where} field 'answers' is empty")
        out.append(NQExample(_field(rec, "question", str, where), answers, tuple(passages)))
    return out


def heldout_split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """``(train, held-out)`` question indices: a seeded permutation's first ``round(n * fraction)`` are held out
    (each list sorted). Raises ValueError unless ``0 < fraction < 1``."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"heldout fraction={fraction} must be in (0, 1)")
    perm = np.random.default_rng(seed).permutation(n)
    k = max(1, round(n * fraction))
    return sorted(perm[k:].tolist()), sorted(perm[:k].tolist())


def nq_passage_pool(examples: list[NQExample]) -> tuple[list[Passage], list[int]]:
    """The retrieval pool of all gold passages, deduplicated by (title, text), and each example's gold index.

    Returns ``(passages, gold_ids)`` with ``passages[gold_ids[i]] == examples[i].gold`` (up to flags).
    """
    index: dict[tuple[str, str], int] = {}
    passages: list[Passage] = []
    gold_ids = []
    for ex in examples:
        g = ex.gold
        key = (g.title, g.text)
        if key not in index:
            index[key] = len(passages)
            passages.append(g)
        gold_ids.append(index[key])
    return passages, gold_ids


def load_kv_retrieval(path: str | os.PathLike, limit: int | None = None) -> list[KVExample]:
    """Load ``kv-retrieval-*_keys.jsonl.gz`` ({ordered_kv_records: [[key, value]], key, value} per line).

    Raises:
      FileNotFoundError; ValueError for bad gzip/JSON, a mistyped field, or a ``key``/``value``
      that is not one of the example's records.
    """
    out = []
    for where, rec in _jsonl(path, "KV retrieval", limit):
        raw = _field(rec, "ordered_kv_records", list, where)
        if not all(isinstance(kv, list) and len(kv) == 2 and all(isinstance(x, str) for x in kv) for kv in raw):
            raise ValueError(f"{where} field 'ordered_kv_records' must be a list of [key, value] string pairs")
        records = tuple((k, v) for k, v in raw)
        key, value = _field(rec, "key", str, where), _field(rec, "value", str, where)
        if (key, value) not in records:
            raise ValueError(f"{where}: ('key', 'value') = ({key!r}, {value!r}) is not among its ordered_kv_records")
        out.append(KVExample(records, key, value))
    return out
