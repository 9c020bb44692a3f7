"""Grain input pipeline for LM training: tfds ArrayRecord source -> shuffle -> tokenize -> pack -> batch.

The source is the project's text (``rag_jax.data.text_tfds``: PhantomWiki articles, train/validation).

Rows are packed first-fit (``grain.experimental.FirstFitPackIterDataset``) into ``seq_len`` tokens with
``segment_ids`` (1, 2, ... per document, 0 = padding) and ``positions`` restarting at 0 per document;
the LM objective runs the core's ``block`` mask on them, so packed documents never attend to each
other. Documents longer than ``seq_len`` are cut into ``seq_len`` pieces first.

Determinism across host counts: the data is split into ``num_shards`` logical shards (document
``i`` goes to shard ``i % num_shards``); shard ``s`` is shuffled (seeded), packed and batched on its own
and fills rows ``[s * r, (s + 1) * r)`` of every global batch (``r = global_batch / num_shards``). A
process reads only the shards of the rows its devices hold, so with a fixed ``num_shards`` the global
batch sequence is the same on 1 or N processes (MaxText shards the source per host instead,
which changes the data order with the host count; research note jax_frameworks.md 2.2, 2.6). The
iterator's state (grain ``get_state``/``set_state``, saved by orbax with the checkpoint) resumes exactly.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from rag_jax.data import text_tfds
from rag_jax.tokenizer import load_tokenizer


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Input pipeline settings.

    Attributes:
      data_dir: tfds data folder holding the prepared dataset (``python -m train.prepare_data``).
      dataset: ``phantom_wiki/articles`` or ``phantom_wiki/articles_p<people>_s<seed>`` (rag_jax.data.text_tfds).
      tokenizer: ``tokenizer.json`` path; None = the one ``prepare_data`` wrote for this dataset.
      seq_len: tokens per packed row.
      num_shards: logical data shards; None = the number of processes. Fix it to keep the data order
        independent of the host count (it must divide the global batch and be a multiple of the
        process count).
      shuffle_seed: seed of the per-epoch document shuffle.
      num_packing_bins: rows packed at a time per shard (more bins = less padding).
      eval_batches: batches of the validation split used for held-out loss.
    """

    data_dir: str | None = None
    dataset: str = "phantom_wiki/articles_p60_s0"
    tokenizer: str | None = None
    seq_len: int = 256
    num_shards: int | None = None
    shuffle_seed: int = 0
    num_packing_bins: int = 4
    eval_batches: int = 4

    def __post_init__(self):
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len={self.seq_len} must be >= 2 tokens")
        if self.num_packing_bins < 1 or self.eval_batches < 0:
            raise ValueError("data.num_packing_bins must be >= 1 and data.eval_batches >= 0")
        if self.num_shards is not None and self.num_shards < 1:
            raise ValueError(f"data.num_shards={self.num_shards} must be >= 1 or null")


def resolve_tokenizer_path(cfg: DataConfig, vocab_size: int) -> Path:
    return Path(cfg.tokenizer) if cfg.tokenizer else text_tfds.tokenizer_path(cfg.dataset, cfg.data_dir, vocab_size)


def check_dataset(cfg: DataConfig, vocab_size: int) -> Path:
    """Fail early (before any compile) when the prepared dataset or tokenizer is missing.

    Returns the tokenizer path. Raises FileNotFoundError naming the folder and the command to make it.
    """
    if cfg.data_dir is None:
        raise FileNotFoundError("data.data_dir is not set; prepare a dataset with "
                                "`python -m train.prepare_data --data_dir DIR` and pass data.data_dir=DIR")
    builder = text_tfds.builder(cfg.dataset, cfg.data_dir)
    if not Path(builder.data_dir).is_dir():
        raise FileNotFoundError(f"dataset directory {builder.data_dir} does not exist; run "
                                f"`python -m train.prepare_data --data_dir {cfg.data_dir} --dataset {cfg.dataset} "
                                f"--vocab_size {vocab_size}` first")
    tok = resolve_tokenizer_path(cfg, vocab_size)
    if not tok.exists():
        raise FileNotFoundError(f"tokenizer {tok} does not exist; run train.prepare_data or set data.tokenizer")
    return tok


class _Tokenize(grain.transforms.Map):
    def __init__(self, tokenizer_path: str):
        self._path = tokenizer_path
        self._tok = None

    def map(self, element):
        if self._tok is None:  # built lazily: a Tokenizer per worker, nothing unpicklable in the graph
            self._tok = load_tokenizer(self._path)
        ids = self._tok.encode(element[text_tfds.TEXT_FIELD].decode("utf-8")).ids
        bos, eos = self._tok.token_to_id("<bos>"), self._tok.token_to_id("<eos>")
        ids = ([bos] if bos is not None else []) + ids + ([eos] if eos is not None else [])
        return {"tokens": np.asarray(ids, np.int32)}


class _Chunk(grain.experimental.FlatMapTransform):
    def __init__(self, seq_len: int, max_fan_out: int):
        self.seq_len = seq_len
        self.max_fan_out = max_fan_out

    def flat_map(self, element):
        t = element["tokens"]
        pieces = [{"tokens": t[i:i + self.seq_len]} for i in range(0, len(t), self.seq_len)]
        if len(pieces) > self.max_fan_out:
            raise ValueError(f"a document of {len(t)} tokens needs {len(pieces)} rows of seq_len={self.seq_len}, "
                             f"more than max_fan_out={self.max_fan_out}")
        return pieces


def _rename(row):
    return {"tokens": row["tokens"], "positions": row["tokens_positions"].astype(np.int32),
            "segment_ids": row["tokens_segment_ids"].astype(np.int32)}


def _concat_rows(*parts):
    return {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}


def host_rows(sharding: NamedSharding, global_batch: int) -> tuple[int, int]:
    """The contiguous row range ``[start, stop)`` of the global batch held by this process's devices.

    Raises ValueError if it is not contiguous (a mesh whose batch axis interleaves processes).
    """
    idx = sharding.addressable_devices_indices_map((global_batch,))
    rows = sorted({r for s in idx.values() for r in range(*s[0].indices(global_batch))})
    if rows != list(range(rows[0], rows[-1] + 1)):
        raise ValueError(f"this process's devices hold non-contiguous batch rows {rows}")
    return rows[0], rows[-1] + 1


def make_lm_dataset(cfg: DataConfig, *, split: str, global_batch: int, tokenizer_path: str | Path,
                    row_range: tuple[int, int] | None = None, shuffle: bool = True,
                    num_shards: int | None = None) -> grain.IterDataset:
    """Packed LM batches of this process's rows: dicts of int32 ``[rows, seq_len]`` tokens/positions/segment_ids.

    Args:
      split: "train" or "validation".
      global_batch: rows per global batch.
      row_range: ``[start, stop)`` rows this process feeds (``host_rows``); default all rows.
      shuffle: shuffle documents per epoch (train); False keeps the source order (eval).
      num_shards: overrides cfg.num_shards (default: jax.process_count()).

    Raises:
      ValueError: num_shards does not divide global_batch, or the row range does not align with shards.
    """
    n = num_shards or cfg.num_shards or jax.process_count()
    if global_batch % n:
        raise ValueError(f"global batch {global_batch} must be divisible by data.num_shards={n}")
    per_shard = global_batch // n
    start, stop = row_range or (0, global_batch)
    if start % per_shard or stop % per_shard:
        raise ValueError(f"rows [{start}, {stop}) of this process do not align with data shards of {per_shard} rows; "
                         f"make data.num_shards a multiple of the process count")
    source = text_tfds.data_source(cfg.dataset, cfg.data_dir, split)
    max_fan_out = 64
    shards = []
    for s in range(start // per_shard, stop // per_shard):
        ds = grain.MapDataset.source(source)[s::n]
        if len(ds) == 0:
            raise ValueError(f"data shard {s} of {n} of split {split!r} is empty ({len(source)} documents)")
        if shuffle:
            ds = ds.seed(cfg.shuffle_seed + s).shuffle()
        ds = ds.repeat(None).map(_Tokenize(str(tokenizer_path))).to_iter_dataset()
        ds = grain.experimental.FlatMapIterDataset(ds, _Chunk(cfg.seq_len, max_fan_out))
        ds = grain.experimental.FirstFitPackIterDataset(
            ds, length_struct={"tokens": cfg.seq_len}, num_packing_bins=cfg.num_packing_bins,
            seed=cfg.shuffle_seed + s, shuffle_bins=shuffle)
        shards.append(ds.map(_rename).batch(per_shard, drop_remainder=True))
    if len(shards) == 1:
        return shards[0]
    return grain.experimental.ZipIterDataset(shards).map(lambda parts: _concat_rows(*parts))
