"""GRIT training batches: (query, positive, hard negatives) triples and instruction/response pairs.

GritLM (ICLR 2025, §2-3; research note ``shared/research/gritlm.md`` §2, §3) trains on two streams
with separate batch sizes and max lengths: an embedding stream and a generative stream.

Record formats (the reference's jsonl, notes §2):
- embedding: ``{"query": text | [instruction, text], "pos": [text | [instruction, text], ...],
  "neg": [...]}``; one positive is drawn at random, ``group_size - 1`` negatives are drawn without
  replacement (the list is repeated when it is shorter, as the reference does).
- generative: ``{"text": [user1, assistant1, user2, assistant2, ...]}``; loss on ``{assistant}</s>``.

Batch arrays (int32, right-padded to the fixed max lengths, so every step has the same shapes):
  ``query_tokens / query_attention_mask / query_pool_mask`` ``[B, query_max_len]``;
  ``passage_*`` ``[B·G, passage_max_len]`` laid out per query as ``[positive, negatives...]``;
  ``gen_tokens / gen_attention_mask / gen_loss_mask`` ``[Bg, generative_max_len]``.
Both streams are grain ``MapDataset``s indexed by step (deterministic, resumable from any step).
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np

from rag_jax.model.embedding import GritFormat, tokenize_for_embedding
from rag_jax.text import Markup, chat_pieces, encode_pieces


@dataclasses.dataclass(frozen=True)
class GritDataConfig:
    """Batch sizes and max lengths of the two GRIT streams (notes §1.4, §4; reference defaults in the
    paper: 2048 queries with G=2, 256 generative samples, lengths 256 / 2048 / 2048).

    Attributes:
      embedding_batch_size: queries per step (B).
      generative_batch_size: instruction/response samples per step (Bg).
      group_size: passages per query G = 1 positive + G-1 hard negatives (``--train_group_size``).
      query_max_len, passage_max_len, generative_max_len: tokens, including the format prefix.
      seed: shuffling and positive/negative sampling seed.
    """

    embedding_batch_size: int = 8
    generative_batch_size: int = 4
    group_size: int = 2
    query_max_len: int = 64
    passage_max_len: int = 128
    generative_max_len: int = 128
    seed: int = 0

    def __post_init__(self):
        for name in ("embedding_batch_size", "generative_batch_size", "group_size", "query_max_len",
                     "passage_max_len", "generative_max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GritDataConfig.{name}={value!r} must be a positive integer")
        for name in ("query_max_len", "passage_max_len", "generative_max_len"):
            if getattr(self, name) < 2:
                raise ValueError(f"GritDataConfig.{name}={getattr(self, name)} must be >= 2 tokens")


@dataclasses.dataclass(frozen=True)
class ChatGritFormat:
    """GRIT prompt formats of a pretrained chat model (a drop-in for ``GritFormat`` in this module and
    ``rag_jax.model.embedding``): generation through the model's own chat template, embedding in its
    turn markup with an ``embed`` turn in place of GritLM's ``<|embed|>`` marker (paper §2).

    - query: ``query_prefix`` with the instruction, e.g. ChatML
      ``<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>embed\n{text}``; document:
      ``document_prefix`` + text. Only the text is pooled (``tokenize_for_embedding``).
    - generation: the template rendered over ``[user, assistant, ...]`` messages without a generation
      prompt (its default system turn included, as at inference); the loss spans are each assistant
      message and the end-of-turn text (``eos``) right after it (paper Eq. 2: ``{assistant}</s>``).

    Attributes:
      template: the Jinja chat template (``LoadedModel.chat_template``).
      special_tokens: ``(name, text)`` pairs the template uses (``LoadedModel.special_tokens`` items).
      eos: the end-of-turn text that follows an assistant message (ChatML ``<|im_end|>``).
      query_prefix, document_prefix: embedding prefixes (``{instruction}`` is filled in).
    """

    template: str
    special_tokens: tuple[tuple[str, str], ...] = ()
    eos: str = "<|im_end|>"
    query_prefix: str = "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>embed\n"
    document_prefix: str = "<|im_start|>embed\n"

    @classmethod
    def from_loaded(cls, loaded) -> "ChatGritFormat":
        """The format of a ``rag_jax.model.load.LoadedModel`` with a ChatML template (its ``eos_token`` ends a turn).

        Raises:
          ValueError: no tokenizer or chat template, or a template that is not ChatML (the embedding prefixes
            are ChatML turns; build the format with matching prefixes for another markup).
        """
        template = loaded.chat_template
        if loaded.tokenizer is None or template is None or "<|im_start|>" not in template:
            raise ValueError(f"model {loaded.source} needs a tokenizer and a ChatML chat template (<|im_start|> "
                             "turns) for ChatGritFormat.from_loaded; pass query_prefix/document_prefix for others")
        special = dict(loaded.special_tokens)
        return cls(template, tuple(sorted(special.items())), eos=special.get("eos_token") or "<|im_end|>")

    def embed_prefix(self, instruction: str = "") -> str:
        """Text before an embedded sample: the query prefix with ``instruction``, or the document prefix."""
        return self.query_prefix.format(instruction=instruction) if instruction else self.document_prefix

    def generation(self, turns: list[str]) -> tuple[str, list[tuple[int, int]]]:
        """``[user1, assistant1, ...]`` -> ``(chat text, [start, end) character spans of each assistant message
        plus the end-of-turn text after it)``.

        Raises:
          ValueError: no turns, an odd number of turns, an empty turn, or a template that drops a message.
        """
        pieces, spans = self.generation_pieces(turns)
        return "".join(pieces), spans

    def generation_pieces(self, turns: list[str]) -> tuple[list[str], list[tuple[int, int]]]:
        """``generation`` as prompt pieces (``rag_jax.text.chat_pieces``: the template's text as ``Markup``, the
        messages as content); ``"".join(pieces)`` is ``generation``'s text. Same spans and errors."""

        if not turns or len(turns) % 2:
            raise ValueError(f"generative 'text' must be [user, assistant, user, assistant, ...] with an even, "
                             f"non-zero number of turns; got {len(turns)} turns")
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t.strip() if i % 2 else t}
                    for i, t in enumerate(turns)]
        if any(not m["content"].strip() for m in messages):
            raise ValueError(f"generative turns must be non-empty; got {turns!r:.200}")
        pieces = chat_pieces(self.template, messages, add_generation_prompt=False, **dict(self.special_tokens))
        text = "".join(pieces)
        spans, at, contents = [], 0, iter(messages)
        for piece in pieces:
            if not isinstance(piece, Markup):
                m, end = next(contents), at + len(piece)
                if m["role"] == "assistant":
                    spans.append((at, end + (len(self.eos) if text.startswith(self.eos, end) else 0)))
            at += len(piece)
        return pieces, spans


def _text_item(value: Any, where: str) -> tuple[str, str]:
    """``text`` or ``[instruction, text]`` -> ``(instruction, text)``; raises ValueError naming ``where``."""
    if isinstance(value, str):
        instruction, text = "", value
    elif isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, str) for v in value):
        instruction, text = value
    else:
        raise ValueError(f"{where} must be a string or [instruction, text]; got {value!r}")
    if not text.strip():
        raise ValueError(f"{where} has an empty text: {value!r}")
    return instruction, text


@dataclasses.dataclass(frozen=True)
class EmbeddingExample:
    query: tuple[str, str]
    positives: tuple[tuple[str, str], ...]
    negatives: tuple[tuple[str, str], ...]


def parse_embedding_record(record: dict, index: int, group_size: int) -> EmbeddingExample:
    """Validate one embedding record.

    Raises:
      ValueError: missing/empty query, no positive, an empty text, or no hard negative while
        ``group_size > 1``.
    """
    if not isinstance(record, dict) or "query" not in record:
        raise ValueError(f"embedding record {index} must be a dict with a 'query' key; got {record!r:.200}")
    query = _text_item(record["query"], f"embedding record {index} 'query'")
    pos = record.get("pos") or []
    if not pos:
        raise ValueError(f"embedding record {index} has a query but no positive ('pos' is {record.get('pos')!r}); "
                         "every query needs at least one positive passage")
    neg = record.get("neg") or []
    if group_size > 1 and not neg:
        raise ValueError(f"embedding record {index} has no hard negative ('neg' is {record.get('neg')!r}) but "
                         f"group_size={group_size} needs {group_size - 1} per query; add negatives or use group_size=1")
    return EmbeddingExample(query,
                            tuple(_text_item(p, f"embedding record {index} 'pos'[{j}]") for j, p in enumerate(pos)),
                            tuple(_text_item(n, f"embedding record {index} 'neg'[{j}]") for j, n in enumerate(neg)))


def _check_prefixes(tokenizer, examples: Sequence[EmbeddingExample], cfg: GritDataConfig, fmt: GritFormat) -> None:
    """Fail before training if any instruction leaves no room for the sample (the reference silently
    filters such records, notes §2; we say which one)."""
    seen: set[tuple[str, int]] = set()
    for i, ex in enumerate(examples):
        sides = [(ex.query[0], cfg.query_max_len, "query")]
        sides += [(p[0], cfg.passage_max_len, "passage") for p in ex.positives + ex.negatives]
        for instruction, max_len, side in sides:
            if (instruction, max_len) in seen:
                continue
            seen.add((instruction, max_len))
            n = len(tokenizer.encode(fmt.embed_prefix(instruction), add_special_tokens=False).ids)
            if n >= max_len:
                raise ValueError(f"embedding record {i}: the {side} instruction {instruction!r:.80} takes {n} tokens "
                                 f"with its format, which is >= {side}_max_len={max_len}; shorten it or raise the "
                                 "max length")


def _pad(rows: Sequence[np.ndarray], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def _sample_group(ex: EmbeddingExample, group_size: int, rng: np.random.Generator) -> list[tuple[str, str]]:
    positive = ex.positives[rng.integers(len(ex.positives))]
    if group_size == 1:
        return [positive]
    negs = list(ex.negatives)
    if len(negs) < group_size - 1:  # the reference repeats a short negative list
        negs = negs * (-(-(group_size - 1) // len(negs)))
    picked = rng.choice(len(negs), size=group_size - 1, replace=False)
    return [positive] + [negs[j] for j in picked]


def tokenize_embedding_example(ex: EmbeddingExample, rng: np.random.Generator, tokenizer, cfg: GritDataConfig,
                               fmt: GritFormat) -> dict[str, np.ndarray]:
    """One query and its G passages -> arrays ``query_* [Lq]`` and ``passage_* [G, Lp]``."""
    q_ids, q_pool = tokenize_for_embedding(tokenizer, ex.query[1], ex.query[0], max_len=cfg.query_max_len, fmt=fmt)
    passages = [tokenize_for_embedding(tokenizer, text, instr, max_len=cfg.passage_max_len, fmt=fmt)
                for instr, text in _sample_group(ex, cfg.group_size, rng)]
    return {
        "query_tokens": _pad([q_ids], cfg.query_max_len)[0],
        "query_attention_mask": _pad([np.ones_like(q_ids)], cfg.query_max_len)[0],
        "query_pool_mask": _pad([q_pool], cfg.query_max_len)[0],
        "passage_tokens": _pad([p for p, _ in passages], cfg.passage_max_len),
        "passage_attention_mask": _pad([np.ones_like(p) for p, _ in passages], cfg.passage_max_len),
        "passage_pool_mask": _pad([m for _, m in passages], cfg.passage_max_len),
    }


def tokenize_generative_record(record: dict, tokenizer, max_len: int, fmt: GritFormat = GritFormat(),
                               index: int = 0) -> dict[str, np.ndarray]:
    """``{"text": [user, assistant, ...]}`` -> ``gen_tokens / gen_attention_mask / gen_loss_mask`` ``[max_len]``.

    ``gen_loss_mask`` is 1 on the tokens of every ``{assistant}</s>`` piece (paper Eq. 2), found from
    character offsets of the joint tokenization (notes §3.3: the reference's per-piece lengths can
    misalign later turns).

    Raises:
      ValueError: a malformed record, an empty turn, or no response token left within ``max_len``.
    """
    if not isinstance(record, dict) or not isinstance(record.get("text"), (list, tuple)):
        raise ValueError(f"generative record {index} must be a dict with a 'text' list; got {record!r:.200}")
    try:
        pieces, spans = fmt.generation_pieces(list(record["text"]))
    except ValueError as e:
        raise ValueError(f"generative record {index}: {e}") from None
    enc = encode_pieces(tokenizer, pieces)   # the turns are content: their special-token text stays text
    ids = np.asarray(enc.ids[:max_len], np.int32)
    starts = np.asarray([s for s, _ in enc.offsets[:max_len]])
    loss = np.zeros(len(ids), np.int32)
    for lo, hi in spans:
        loss |= ((starts >= lo) & (starts < hi)).astype(np.int32)
    if not loss.any():
        raise ValueError(f"generative record {index} has no response token within generative_max_len={max_len} "
                         f"(prompt of {len(enc.ids)} tokens); raise the max length or shorten the prompt")
    return {"gen_tokens": _pad([ids], max_len)[0], "gen_attention_mask": _pad([np.ones_like(ids)], max_len)[0],
            "gen_loss_mask": _pad([loss], max_len)[0]}


def _stack(items: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    batch = {k: np.stack([it[k] for it in items]) for k in items[0]}
    for k in [k for k in batch if k.startswith("passage_")]:  # [B, G, Lp] -> [B·G, Lp]: per query [pos, negs...]
        batch[k] = batch[k].reshape(-1, batch[k].shape[-1])
    return batch


def embedding_dataset(records: Sequence[dict], tokenizer, cfg: GritDataConfig,
                      fmt: GritFormat = GritFormat()) -> grain.MapDataset:
    """An endless, step-indexed ``MapDataset`` of embedding batches (records validated up front).

    Raises:
      ValueError: fewer records than ``embedding_batch_size``, or any bad record (see
        ``parse_embedding_record``) or instruction too long for its max length.
    """
    if len(records) < cfg.embedding_batch_size:
        raise ValueError(f"{len(records)} embedding records < embedding_batch_size={cfg.embedding_batch_size}")
    examples = [parse_embedding_record(r, i, cfg.group_size) for i, r in enumerate(records)]
    _check_prefixes(tokenizer, examples, cfg, fmt)
    return (grain.MapDataset.source(examples).shuffle(seed=cfg.seed).repeat(None)
            .random_map(lambda ex, rng: tokenize_embedding_example(ex, rng, tokenizer, cfg, fmt), seed=cfg.seed)
            .batch(cfg.embedding_batch_size, drop_remainder=True, batch_fn=_stack))


def generative_dataset(records: Sequence[dict], tokenizer, cfg: GritDataConfig,
                       fmt: GritFormat = GritFormat()) -> grain.MapDataset:
    """An endless, step-indexed ``MapDataset`` of generative batches (records tokenized up front).

    Raises:
      ValueError: fewer records than ``generative_batch_size`` or any bad record.
    """
    if len(records) < cfg.generative_batch_size:
        raise ValueError(f"{len(records)} generative records < generative_batch_size={cfg.generative_batch_size}")
    items = [tokenize_generative_record(r, tokenizer, cfg.generative_max_len, fmt, i) for i, r in enumerate(records)]
    return (grain.MapDataset.source(items).shuffle(seed=cfg.seed + 1).repeat(None)
            .batch(cfg.generative_batch_size, drop_remainder=True, batch_fn=_stack))


def grit_batches(embedding_records: Sequence[dict] | None, generative_records: Sequence[dict] | None, tokenizer,
                 cfg: GritDataConfig, fmt: GritFormat = GritFormat(), start_step: int = 0
                 ) -> Iterator[dict[str, np.ndarray]]:
    """Endless iterator of GRIT step batches from ``start_step`` on; either stream may be None
    (embedding-only / generative-only training). Each batch merges the two streams' arrays.

    Raises:
      ValueError: both streams None, or bad records (raised here, before the first batch).
    """
    if embedding_records is None and generative_records is None:
        raise ValueError("grit_batches needs embedding_records, generative_records or both")
    streams = []
    if embedding_records is not None:
        streams.append(embedding_dataset(embedding_records, tokenizer, cfg, fmt))
    if generative_records is not None:
        streams.append(generative_dataset(generative_records, tokenizer, cfg, fmt))

    def steps():
        for step in itertools.count(start_step):
            batch = {}
            for ds in streams:
                batch.update(ds[step])
            yield batch

    return steps()
