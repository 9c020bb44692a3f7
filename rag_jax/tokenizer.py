"""Tokenizers via the `tokenizers` library: byte-level BPE training for from-scratch models, and loading
``tokenizer.json`` files (HF checkpoints, our own runs). Nothing is downloaded.

Imports only ``tokenizers`` and numpy, so every layer (the model loader included) can use it."""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
DEFAULT_SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # the special tokens of the tokenizers trained here (run folders)


def eos_tuple(eos_id: int | Sequence[int] | None) -> tuple[int, ...]:
    """``eos_id`` as a tuple of ints (``None`` -> empty). Raises TypeError naming the bad value."""
    if eos_id is None:
        return ()
    ids = (eos_id,) if isinstance(eos_id, (int, np.integer)) else tuple(eos_id)
    if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids):
        raise TypeError(f"eos_id={eos_id!r} must be an int or a sequence of ints")
    return tuple(int(i) for i in ids)


def train_bpe(texts: Iterable[str], vocab_size: int, *, special_tokens: Iterable[str] = DEFAULT_SPECIAL_TOKENS,
              min_frequency: int = 2, save_path: str | os.PathLike | None = None) -> Tokenizer:
    """Train a byte-level BPE tokenizer on an iterator of texts.

    Special tokens get the first ids in the order given (``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``<unk>``=3 by
    default). The byte-level alphabet (256 symbols) is always included, so any text is encodable.

    Raises: ValueError if ``vocab_size`` cannot hold the special tokens and the 256 bytes.
    """
    special_tokens = list(special_tokens)
    minimum = 256 + len(special_tokens)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size={vocab_size} is too small: byte-level BPE needs >= {minimum} "
                         f"(256 bytes + {len(special_tokens)} special tokens)")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if save_path is not None:
        save_tokenizer(tok, save_path)
    return tok


def save_tokenizer(tok: Tokenizer, path: str | os.PathLike) -> Path:
    """Write ``tokenizer.json`` atomically (a file path, or a folder that receives ``tokenizer.json``)."""
    path = Path(path)
    if path.is_dir() or not path.suffix:
        path.mkdir(parents=True, exist_ok=True)
        path = path / "tokenizer.json"
    tmp = path.with_name(path.name + ".tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)
    return path


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load ``tokenizer.json`` from a file path or a checkpoint folder.

    Raises: FileNotFoundError if absent; ValueError (naming the file) if it is not a valid tokenizer.json.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"tokenizer file {path} not found")
    try:
        return Tokenizer.from_file(str(path))
    except (KeyboardInterrupt, SystemExit):
        raise
    # the tokenizers library raises a bare Exception with serde's message, and a Rust panic surfaces as pyo3's
    # PanicException, a BaseException (a fuzzed tokenizer.json found one): both are a malformed file
    except BaseException as e:  # noqa: B036
        reason = (str(e).strip().splitlines() or ["unreadable"])[0][:200]
        raise ValueError(f"tokenizer file {path} is not a valid tokenizer.json ({reason})") from None


def byte_tokenizer() -> Tokenizer:
    """A ``tokenizers`` tokenizer whose token ids are the UTF-8 bytes of the text (vocabulary 256, no merges):
    the tokenizer.json of byte-level models (``rag-jax eval passkey``), so their run folders are complete.

    Byte ``b`` is the byte-level alphabet symbol of GPT-2's byte-to-unicode table (printable Latin-1 bytes map
    to themselves, the others to ``chr(256 + i)`` in byte order), which ``pre_tokenizers.ByteLevel`` applies.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    symbol = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    tok = Tokenizer(models.BPE(vocab={symbol[b]: b for b in range(256)}, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok
