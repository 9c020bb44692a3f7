"""tfds builder for PhantomWiki universes, written as array_record (random access; no TensorFlow needed).

Source: a universe from :func:`rag_jax.data.phantom.generate_universe` (default) or a local
PhantomWiki-format folder (``source_dir``, read with :func:`rag_jax.data.loaders.load_phantomwiki`).
Nothing is downloaded. One config holds one record kind, because a tfds dataset has one feature set:

* ``kind="articles"``: split ``train`` (all articles) — ``title``, ``article`` (text), ``facts`` [str].
* ``kind="questions"``: splits ``train`` / ``test`` (a seeded ``test_fraction`` of the questions) —
  ``id``, ``question``, ``answer`` [str], ``hops`` int32, ``titles`` [str] (empty when unknown).

Reading: ``tfds.data_source("phantom_wiki/questions", data_dir=...)`` for the registered configs,
``tfds.builder_from_directory(path).as_data_source()`` for any built config; both give
``ArrayRecordDataSource`` objects (``len``, ``__getitem__``) that ``grain.MapDataset.source`` accepts.
Text comes back as ``bytes``; :func:`decode` turns a record into plain Python values.

Checked with tensorflow-datasets 4.9.10 without TensorFlow installed: ``file_format="array_record"``
builds, ``as_data_source`` reads. Only ``DatasetInfo`` is built directly (``dataset_info_from_configs``
reads package metadata files this module does not ship).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import random
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from rag_jax.data.loaders import load_phantomwiki
from rag_jax.data.phantom import generate_universe

__all__ = ["PhantomWikiConfig", "PhantomWiki", "prepare", "decode"]

_KINDS = ("articles", "questions")


@dataclasses.dataclass(eq=False)
class PhantomWikiConfig(tfds.core.BuilderConfig):
    """What to build. Generator arguments are those of ``generate_universe``; ``source_dir`` overrides them."""
    kind: str = "questions"
    num_people: int = 100
    seed: int = 0
    max_hops: int = 3
    num_questions: int = 200
    source_dir: str | None = None
    test_fraction: float = 0.2

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"PhantomWikiConfig.kind={self.kind!r} must be one of {_KINDS}")
        if not 0.0 <= self.test_fraction < 1.0:
            raise ValueError(f"PhantomWikiConfig.test_fraction={self.test_fraction!r} must be in [0, 1)")


class PhantomWiki(tfds.core.GeneratorBasedBuilder):
    """PhantomWiki articles or questions (see module docstring)."""

    VERSION = tfds.core.Version("1.0.0")
    # tfds derives this from the top-level package, which fails when ``rag_jax`` is imported as a
    # namespace package (a stale editable install); the builder only needs it to look for checksums.
    code_path = epath.Path(__file__)
    RELEASE_NOTES = {"1.0.0": "First release: rag_jax.data.phantom generator v1."}
    BUILDER_CONFIGS = [
        PhantomWikiConfig(name="articles", kind="articles", description="100-person universe, seed 0: articles"),
        PhantomWikiConfig(name="questions", kind="questions", description="100-person universe, seed 0: questions"),
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        text_list = tfds.features.Sequence(tfds.features.Text())
        if self.builder_config.kind == "articles":
            features = {"title": tfds.features.Text(), "article": tfds.features.Text(), "facts": text_list}
        else:
            features = {"id": tfds.features.Text(), "question": tfds.features.Text(), "answer": text_list,
                        "hops": np.int32, "titles": text_list}
        return tfds.core.DatasetInfo(
            builder=self, description=__doc__, features=tfds.features.FeaturesDict(features),
            homepage="https://github.com/kilian-group/phantom-wiki")

    def _records(self) -> tuple[list[dict], list[dict]]:
        c = self.builder_config
        if c.source_dir is not None:
            data = load_phantomwiki(c.source_dir)
            articles = [{"title": a.title, "article": a.article, "facts": list(a.facts)} for a in data.articles]
            questions = [{"id": q.id, "question": q.question, "answer": list(q.answer), "hops": q.hops,
                          "titles": list(q.titles or ())} for q in data.questions]
            return articles, questions
        u = generate_universe(c.num_people, c.seed, c.max_hops, c.num_questions)
        keys = ("id", "question", "answer", "hops", "titles")
        return u.articles, [{k: q[k] for k in keys} for q in u.questions]

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Any]:
        articles, questions = self._records()
        if self.builder_config.kind == "articles":
            return {"train": self._generate_examples(articles, "title")}
        order = list(range(len(questions)))
        random.Random(self.builder_config.seed).shuffle(order)
        n_test = round(len(questions) * self.builder_config.test_fraction)
        test = set(order[:n_test])
        return {
            "train": self._generate_examples([q for i, q in enumerate(questions) if i not in test], "id"),
            "test": self._generate_examples([q for i, q in enumerate(questions) if i in test], "id"),
        }

    def _generate_examples(self, records: list[dict], key: str):
        for r in records:
            yield r[key], r


def prepare(data_dir: str | os.PathLike, config: PhantomWikiConfig | str = "questions") -> PhantomWiki:
    """Build (once) and return the builder; read it with ``builder.as_data_source()``.

    Args:
      data_dir: tfds data directory; the dataset lands in ``data_dir/phantom_wiki/<config>/1.0.0``.
      config: a registered config name (``"articles"``, ``"questions"``) or a PhantomWikiConfig.
        A config already built under ``data_dir`` is reused as is, so give each custom config a
        name unique to its parameters (e.g. ``"questions_p1000_s3"``).

    Raises:
      ValueError from the config or the generator; FileNotFoundError/ValueError from ``source_dir``.
    """
    builder = PhantomWiki(config=config, data_dir=os.fspath(data_dir), file_format="array_record")
    # tfds draws its own tqdm bars: only on a terminal, as rag_jax.progress (no carriage returns in a log file)
    tfds.display_progress_bar(sys.stderr.isatty())
    builder.download_and_prepare()
    return builder


def decode(example: dict[str, Any]) -> dict[str, Any]:
    """A data-source record with ``bytes`` / numpy values -> ``str``, ``list[str]``, ``int``."""
    def conv(v):
        if isinstance(v, bytes):
            return v.decode("utf-8")
        if isinstance(v, np.ndarray):
            return [conv(x) for x in v.tolist()] if v.ndim else conv(v.item())
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, np.generic):
            return v.item()
        return v
    return {k: conv(v) for k, v in example.items()}
