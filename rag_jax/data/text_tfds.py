"""The project's LM text: PhantomWiki articles from the ``phantom_wiki`` tfds builder (ArrayRecord, no TensorFlow).

Dataset names: ``phantom_wiki/articles`` (the builder's registered 100-person universe) or
``phantom_wiki/articles_p<people>_s<seed>`` (any generated universe, e.g. ``articles_p60_s0``), built
by ``rag_jax.data.phantom_tfds`` into ``<data_dir>/phantom_wiki/<config>/1.0.0`` (tfds writes to an
``incomplete.*`` folder and renames it, so a partial build is never read).

The builder stores every article in ``train``; the LM held-out split is made here by record index:
every ``VALIDATION_EVERY``-th record is ``validation``, the rest ``train``, so held-out loss is measured
on articles never trained on. ``prepare_text_dataset`` also trains the byte-level BPE tokenizer on the
train records (``rag_jax.tokenizer.train_bpe``), written atomically next to the dataset.
"""
from __future__ import annotations

import re
from pathlib import Path

from rag_jax.data import phantom_tfds
from rag_jax.tokenizer import load_tokenizer, train_bpe

VALIDATION_EVERY = 10
TEXT_FIELD = "article"
SPLITS = ("train", "validation")
_CUSTOM = re.compile(r"articles_p(\d+)_s(\d+)")


def builder_config(name: str) -> phantom_tfds.PhantomWikiConfig | str:
    """``phantom_wiki/articles`` or ``phantom_wiki/articles_p<people>_s<seed>`` -> the builder config.

    Raises ValueError for any other name.
    """
    ds, _, config = name.partition("/")
    if ds == "phantom_wiki" and config == "articles":
        return config
    match = _CUSTOM.fullmatch(config) if ds == "phantom_wiki" else None
    if match is None:
        raise ValueError(f"dataset {name!r} is not known; valid: 'phantom_wiki/articles' or "
                         "'phantom_wiki/articles_p<people>_s<seed>' (e.g. phantom_wiki/articles_p60_s0)")
    return phantom_tfds.PhantomWikiConfig(name=config, kind="articles", num_people=int(match[1]),
                                          seed=int(match[2]), num_questions=0,
                                          description=f"{match[1]} people, seed {match[2]}: articles")


def builder(name: str, data_dir: str | Path) -> phantom_tfds.PhantomWiki:
    """The (possibly not yet built) tfds builder of dataset ``name`` under ``data_dir``."""
    return phantom_tfds.PhantomWiki(config=builder_config(name), data_dir=str(data_dir), file_format="array_record")


class SplitView:
    """Random-access view (``len``, ``[i]``) of one LM split of the builder's ``train`` records."""

    def __init__(self, source, split: str):
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; valid: {SPLITS}")
        self._source = source
        held_out = split == "validation"
        self._index = [i for i in range(len(source)) if (i % VALIDATION_EVERY == 0) == held_out]

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int):
        return self._source[self._index[i]]


def data_source(name: str, data_dir: str | Path, split: str) -> SplitView:
    """Records ``{"title", "article", "facts"}`` (text as bytes) of ``split`` ("train" or "validation")."""
    return SplitView(builder(name, data_dir).as_data_source(split="train"), split)


def tokenizer_path(name: str, data_dir: str | Path, vocab_size: int) -> Path:
    return Path(data_dir) / "tokenizers" / f"{name.replace('/', '_')}_bpe{vocab_size}.json"


def prepare_text_dataset(name: str, data_dir: str | Path, vocab_size: int) -> Path:
    """Build the dataset (if absent) and its BPE tokenizer (if absent); returns the tokenizer path."""
    phantom_tfds.prepare(data_dir, builder_config(name))
    path = tokenizer_path(name, data_dir, vocab_size)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        train = data_source(name, data_dir, "train")
        train_bpe((train[i][TEXT_FIELD].decode("utf-8") for i in range(len(train))), vocab_size, save_path=path)
    load_tokenizer(path)
    return path
