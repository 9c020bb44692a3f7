"""The project's text corpus as a tensorflow-datasets builder in ``array_record`` format (no TensorFlow).

``phantom_text``: one example per PhantomWiki-style article (``rag_jax.data.phantom.generate_universe``,
or an ``articles.json`` of the official generator), ``{"title": str, "text": str}``. Every 10th article
(sorted by title) goes to ``validation``, the rest to ``train``, so held-out loss is measured on
articles never trained on. ArrayRecord gives grain random access (research note jax_frameworks.md 2.6).

``prepare_text_dataset`` builds it (tfds writes to an ``incomplete.*`` folder and renames it, so a
partial build is never read) and trains a byte-level BPE tokenizer on the train split
(``rag_jax.data.tokenizer.train_bpe``), written atomically next to it.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import tensorflow_datasets as tfds
from etils import epath

from rag_jax.data.phantom import generate_universe
from rag_jax.data.tokenizer import load_tokenizer, train_bpe

VALIDATION_EVERY = 10


@dataclasses.dataclass
class PhantomTextConfig(tfds.core.BuilderConfig):
    """num_people/seed: arguments of ``generate_universe``; articles_json: read this file instead."""

    num_people: int = 100
    seed: int = 0
    articles_json: str | None = None


class PhantomText(tfds.core.GeneratorBasedBuilder):
    """Articles of a generated PhantomWiki universe as plain text (title + article)."""

    VERSION = tfds.core.Version("1.0.0")

    # tfds resolves a package builder's source path through `importlib_resources`, which it does not
    # install; the plain file path is what it would find anyway.
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(__file__)

    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = [
        PhantomTextConfig(name="tiny", description="60 people, seed 0", num_people=60, seed=0),
        PhantomTextConfig(name="small", description="400 people, seed 0", num_people=400, seed=0),
        PhantomTextConfig(name="medium", description="3000 people, seed 0", num_people=3000, seed=0),
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="PhantomWiki-style fictional articles (rag_jax.data.phantom), one example per article.",
            features=tfds.features.FeaturesDict({"title": tfds.features.Text(), "text": tfds.features.Text()}),
        )

    def _articles(self) -> list[dict]:
        cfg = self.builder_config
        if cfg.articles_json:
            articles = json.loads(Path(cfg.articles_json).read_text())
        else:
            articles = generate_universe(num_people=cfg.num_people, seed=cfg.seed, num_questions=0).articles
        return sorted(articles, key=lambda a: a["title"])

    def _split_generators(self, dl_manager):
        articles = self._articles()
        return {
            "train": self._generate_examples([a for i, a in enumerate(articles) if i % VALIDATION_EVERY]),
            "validation": self._generate_examples(articles[::VALIDATION_EVERY]),
        }

    def _generate_examples(self, articles):
        for a in articles:
            yield a["title"], {"title": a["title"], "text": a["article"]}


def builder(name: str, data_dir: str | Path) -> PhantomText:
    """``name`` is ``phantom_text/<config>`` (tiny, small, medium) or ``phantom_text`` (= tiny).

    Raises:
      ValueError: unknown dataset or config name.
    """
    ds_name, _, config = name.partition("/")
    if ds_name != "phantom_text":
        raise ValueError(f"dataset {name!r} is not known; valid: phantom_text/<config> with config in "
                         f"{[c.name for c in PhantomText.BUILDER_CONFIGS]}")
    valid = {c.name for c in PhantomText.BUILDER_CONFIGS}
    if config and config not in valid:
        raise ValueError(f"dataset config {config!r} of phantom_text is not known; valid: {sorted(valid)}")
    return PhantomText(config=config or "tiny", data_dir=str(data_dir), file_format="array_record")


def tokenizer_path(name: str, data_dir: str | Path, vocab_size: int) -> Path:
    return Path(data_dir) / "tokenizers" / f"{name.replace('/', '_')}_bpe{vocab_size}.json"


def prepare_text_dataset(name: str, data_dir: str | Path, vocab_size: int) -> Path:
    """Build the dataset (if absent) and its BPE tokenizer (if absent); returns the tokenizer path."""
    b = builder(name, data_dir)
    b.download_and_prepare()
    path = tokenizer_path(name, data_dir, vocab_size)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        train = b.as_data_source(split="train")
        texts = (train[i]["text"].decode("utf-8") for i in range(len(train)))
        train_bpe(texts, vocab_size, save_path=path)
    load_tokenizer(path)
    return path
