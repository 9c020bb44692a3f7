"""Block-Attention training examples: RAG prompts as blocks, and a splitter for general SFT text.

Block-Attention (Ma, Wang, Lan, ICLR 2025 "Block-Attention for Efficient Prefilling", §2.1 and
research note ``shared/research/block_attention.md`` §1.1): the prompt is cut into blocks; every block
except the last is encoded causally on its own, the last block (instruction + question + assistant
tag) and the response attend to everything before them.

Every block is **tokenized on its own** and the ids are concatenated (as the reference pipeline does
with ``tokenizer.encode(block, add_special_tokens=False)``), so a block's cached KV at inference time
is computed from exactly the ids it had in training. The ids are therefore *not* the tokenization of
the joined prompt string. No BOS token is added (note §1.3: exactness needs identical block inputs).

Array layout of one example (``BlockExample.to_arrays``), all ``[seq]``:
  tokens int32; positions int32 = 0..N-1 (global positions, note §1.2); segment_ids int32 = block
  number 1..n (the last prompt block and the response share id n), 0 = padding; is_global bool, True
  on the last block and the response; loss_mask float32, 1.0 on response tokens (the targets).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rag_jax.text import Markup, encode_pieces

# Tulu-format strings of the v5 release (note §1.1, ``data_process/rag/step2_to_tulu_format.py``).
RAG_SYSTEM = ("<|user|>\nYou are an intelligent AI assistant. Please answer questions based on the user's "
              "instructions. Below are some reference documents that may help you in answering the user's "
              "question.\n\n")
RAG_PASSAGE = "- Title: {title}\n{text}\n"
RAG_LAST = ("\n\nPlease write a high-quality answer for the given question using only the provided search "
            "documents (some of which might be irrelevant).\nQuestion: {question}\n<|assistant|>\n")
END_OF_TEXT = "<|end_of_text|>"
ASSISTANT_TAG = "<|assistant|>\n"
# Role wrappers of the SFT blocks (note §1.1, ``src/data/tools.py``).
ROLE_WRAPPERS = {
    "system": ("<|system|>\n", "\n"),
    "user": ("<|user|>\n", "\n"),
    "assistant": ("<|assistant|>\n", END_OF_TEXT + "\n"),
}
# The mode marker of v5 block fine-tuning (note §1.2); prepended to block 0 by the objective.
BLOCK_MARKER = "[Block-Attention]"

# Delimiters in priority order (note §1.1): the first one present in a text splits it. Each pattern
# swallows the whitespace around the delimiter, which stays attached to the preceding chunk.
DELIMITERS = ("\n\n", "---", "===", "\n\t", "\n")
_DELIMITER_PATTERNS = {
    "\n\n": re.compile(r"\s*\n\n\s*"),
    "---": re.compile(r"\s*-{3,}\s*"),
    "===": re.compile(r"\s*={3,}\s*"),
    "\n\t": re.compile(r"\n\t"),
    "\n": re.compile(r"\s*\n\s*"),
}


def encode(tokenizer: Any, *pieces: str) -> list[int]:
    """Token ids of ``pieces`` joined, no BOS, by the one prompt rule (``rag_jax.text.encode_pieces``):
    ``Markup`` pieces (a format's ``<eos>``, role tags) have their special tokens parsed; all other text is
    content, where special-token text stays text (a retrieved passage cannot forge a control token).

    Accepts a ``tokenizers.Tokenizer``, a transformers tokenizer or a plain callable ``text -> list[int]``.
    """
    return encode_pieces(tokenizer, pieces).ids


@dataclasses.dataclass(frozen=True)
class BlockExample:
    """A prompt cut into blocks plus a response, as token ids.

    Attributes:
      blocks: the prompt blocks, each a non-empty list of token ids; ``blocks[-1]`` is the global
        (last) block, all earlier blocks are local.
      response: the response token ids (the loss targets), possibly empty at inference time.
    """

    blocks: tuple[tuple[int, ...], ...]
    response: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "blocks", tuple(tuple(int(t) for t in b) for b in self.blocks))
        object.__setattr__(self, "response", tuple(int(t) for t in self.response))
        if not self.blocks:
            raise ValueError("BlockExample.blocks is empty; a prompt needs at least one block (the last block)")
        for i, block in enumerate(self.blocks):
            if len(block) == 0:
                raise ValueError(f"BlockExample.blocks[{i}] is empty; every block needs at least one token")

    @property
    def num_tokens(self) -> int:
        """Total tokens: all blocks plus the response."""
        return sum(len(b) for b in self.blocks) + len(self.response)

    @property
    def prompt(self) -> list[int]:
        """The prompt ids (blocks concatenated), as full attention sees them."""
        return [t for b in self.blocks for t in b]

    def to_arrays(self, seq_len: int | None = None) -> dict[str, np.ndarray]:
        """The training arrays ``[seq_len]`` described in the module docstring, right-padded.

        Raises:
          ValueError: ``seq_len`` is shorter than ``num_tokens``.
        """
        n = self.num_tokens
        seq_len = n if seq_len is None else seq_len
        if seq_len < n:
            raise ValueError(f"seq_len={seq_len} is shorter than the example ({n} tokens); "
                             "raise seq_len or drop/shorten the example")
        tokens = np.zeros(seq_len, np.int32)
        segment_ids = np.zeros(seq_len, np.int32)
        is_global = np.zeros(seq_len, bool)
        loss_mask = np.zeros(seq_len, np.float32)
        tokens[:n] = self.prompt + list(self.response)
        start = 0
        for i, block in enumerate(self.blocks):
            segment_ids[start:start + len(block)] = i + 1
            start += len(block)
        last = len(self.blocks)
        start -= len(self.blocks[-1])
        segment_ids[start:n] = last
        is_global[start:n] = True
        loss_mask[n - len(self.response):n] = 1.0
        positions = np.where(segment_ids > 0, np.arange(seq_len, dtype=np.int32), 0).astype(np.int32)
        return {"tokens": tokens, "positions": positions, "segment_ids": segment_ids,
                "is_global": is_global, "loss_mask": loss_mask}


def collate(examples: Sequence[BlockExample], seq_len: int) -> dict[str, np.ndarray]:
    """Stack examples into a batch of ``[batch, seq_len]`` arrays (right-padded, see ``to_arrays``)."""
    if not examples:
        raise ValueError("collate needs at least one example")
    rows = [ex.to_arrays(seq_len) for ex in examples]
    return {key: np.stack([r[key] for r in rows]) for key in rows[0]}


def mixed_batch(examples: Sequence[BlockExample], seq_len: int) -> dict[str, np.ndarray]:
    """The 1:1 full / block batch of ``examples``: ``2 * len(examples)`` rows ``[2B, seq_len]``, rows ``0..B-1``
    in full attention and rows ``B..2B-1`` in block attention (``collate``), each example once in each mode.

    Block-Attention's v5 recipe trains every sample in both modes (``train_full_attention=true``; research note
    ``block_attention.md`` §1.4). A full row is a block row whose every token is global (``is_global =
    segment_ids > 0``): the core's ``block`` mask ``(k <= q) & (seg_q == seg_k | is_global_q)`` is then plain
    causal attention, so one ``mode="block"`` forward runs both kinds of rows
    (``rag_jax.train.objectives.block.MixedBlockLoss``).

    Raises:
      ValueError: no examples, or an example longer than ``seq_len``.
    """
    block = collate(examples, seq_len)
    full = {**block, "is_global": block["segment_ids"] > 0}
    return {k: np.concatenate([full[k], block[k]]) for k in block}


def build_rag_example(tokenizer: Any, question: str, passages: Sequence[dict[str, str]], response: str = "", *,
                      passages_per_block: int = 1, system: str = RAG_SYSTEM, passage_format: str = RAG_PASSAGE,
                      last_format: str = RAG_LAST, response_suffix: str = END_OF_TEXT,
                      max_len: int | None = None) -> BlockExample:
    """A RAG example: system block, passage blocks, last block (instruction + question + assistant tag).

    Each block string is tokenized separately (no special tokens) and the response gets
    ``response_suffix`` (``<|end_of_text|>``), as in note §1.1.

    Args:
      tokenizer: see ``encode``.
      question: the question text.
      passages: retrieved passages in prompt order, each ``{"title": str, "text": str}``.
      response: the answer text (empty at inference time, then no suffix is added either).
      passages_per_block: passages grouped into one block (the reference readme groups 3).
      system, passage_format, last_format, response_suffix: the template strings.
      max_len: if set, the example's total tokens must not exceed it.

    Raises:
      ValueError: ``passages_per_block < 1``, a passage without ``title``/``text``, or more than
        ``max_len`` tokens.
    """
    if passages_per_block < 1:
        raise ValueError(f"passages_per_block={passages_per_block} must be >= 1")
    texts = [system] if system else []
    for i in range(0, len(passages), passages_per_block):
        group = passages[i:i + passages_per_block]
        for j, p in enumerate(group):
            if "title" not in p or "text" not in p:
                raise ValueError(f"passages[{i + j}] has keys {sorted(p)}; it needs 'title' and 'text'")
        texts.append("".join(passage_format.format(title=p["title"], text=p["text"]) for p in group))
    before, after = last_format.split("{question}", 1) if "{question}" in last_format else (last_format, "")
    pieces = [[Markup(system)]] if system else []
    pieces += [[t] for t in texts[len(pieces):]]            # passages: content
    pieces.append([Markup(before.format()), question, Markup(after.format())])
    blocks = tuple(tuple(encode(tokenizer, *p)) for p in pieces)
    response_ids = tuple(encode(tokenizer, response, Markup(response_suffix))) if response else ()
    example = BlockExample(blocks, response_ids)
    if max_len is not None and example.num_tokens > max_len:
        raise ValueError(f"RAG example has {example.num_tokens} tokens > max_len={max_len}; "
                         "use fewer or shorter passages")
    return example


def split_by_delimiter(text: str) -> list[str]:
    """Split ``text`` at the highest-priority delimiter it contains (``DELIMITERS``).

    The delimiter (with surrounding whitespace) stays attached to the preceding chunk, so
    ``"".join(chunks) == text``. A leading or trailing delimiter does not create a chunk of its own.
    """
    for delimiter in DELIMITERS:
        if delimiter in text:
            cuts = [m.end() for m in _DELIMITER_PATTERNS[delimiter].finditer(text)
                    if m.start() > 0 and m.end() < len(text)]
            bounds = [0, *cuts, len(text)]
            return [text[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return [text]


def merge_smallest(chunks: Sequence[str], max_blocks: int, size: Callable[[str], int] = len) -> list[str]:
    """Merge the adjacent pair with the smallest combined ``size`` until at most ``max_blocks`` remain.

    The reference (``merge_message_blocks``) merges the smallest chunk with a neighbour but never
    updates its running minimum, so it effectively picks the last message; we take the global
    smallest adjacent pair.
    """
    if max_blocks < 1:
        raise ValueError(f"max_blocks={max_blocks} must be >= 1")
    chunks = list(chunks)
    sizes = [size(c) for c in chunks]
    while len(chunks) > max_blocks:
        i = min(range(len(chunks) - 1), key=lambda j: sizes[j] + sizes[j + 1])
        chunks[i:i + 2] = [chunks[i] + chunks[i + 1]]
        sizes[i:i + 2] = [size(chunks[i])]
    return chunks


def split_blocks(text: str, max_blocks: int = 14, size: Callable[[str], int] = len) -> list[str]:
    """Delimiter split (``split_by_delimiter``) then ``merge_smallest`` down to ``max_blocks``.

    ``max_blocks=14`` matches the reference's "merge while >= 15 chunks". ``size`` measures a chunk
    (characters by default, as in the reference; pass a token counter to merge by tokens).
    """
    return merge_smallest(split_by_delimiter(text), max_blocks, size)


def merge_within_messages(messages: Sequence[Sequence[str]], max_blocks: int,
                          size: Callable[[str], int] = len) -> list[list[str]]:
    """Merge adjacent chunks of the same message, smallest combined ``size`` first, until at most
    ``max_blocks`` chunks remain in total or every message is a single chunk.

    Text of two messages never shares a chunk, so with more messages than ``max_blocks`` the result
    keeps one chunk per message (the reference ``post_process_messages`` in
    ``data_process/tulu3/preprocess_block.py`` also merges within a message only and stops there).
    The reference merges a message's smallest chunk with a neighbour; we take the smallest adjacent
    pair over all messages (same rule as ``merge_smallest``).

    Args:
      messages: per message, its chunks in order (each message has at least one chunk).
      max_blocks: the target total number of chunks, >= 1.
      size: measures a chunk (characters by default; pass a token counter to merge by tokens).

    Raises:
      ValueError: ``max_blocks < 1`` or a message without chunks.
    """
    if max_blocks < 1:
        raise ValueError(f"max_blocks={max_blocks} must be >= 1")
    groups = [list(g) for g in messages]
    for i, g in enumerate(groups):
        if not g:
            raise ValueError(f"messages[{i}] has no chunks; every message needs at least one")
    sizes = [[size(c) for c in g] for g in groups]
    while sum(len(g) for g in groups) > max_blocks:
        pairs = [(s[j] + s[j + 1], m, j) for m, s in enumerate(sizes) for j in range(len(s) - 1)]
        if not pairs:
            break
        _, m, j = min(pairs)
        groups[m][j:j + 2] = [groups[m][j] + groups[m][j + 1]]
        sizes[m][j:j + 2] = [size(groups[m][j])]
    return groups


def build_sft_example(tokenizer: Any, messages: Sequence[dict[str, str]], *, max_blocks: int = 14,
                      size: Callable[[str], int] = len) -> BlockExample:
    """A block example from a chat: the final assistant message is the response.

    Following note §1.1: earlier messages are wrapped in their role tags and split at delimiters; in a
    multi-turn chat the last user message is one global block, in a single-turn chat the last chunk
    of the user message is the global block. ``<|assistant|>\\n`` ends the last block. Chunks are
    merged within their message only (``merge_within_messages``, smallest adjacent pair first) down to
    ``max_blocks`` blocks in total; a block never holds text of two messages, so a prompt of more than
    ``max_blocks`` messages gets one block per message.

    Raises:
      ValueError: fewer than 2 messages, a role outside ``ROLE_WRAPPERS``, the last message is not
        from the assistant, or ``max_blocks < 1``.
    """
    if len(messages) < 2:
        raise ValueError(f"messages has {len(messages)} entries; need at least a user and an assistant message")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLE_WRAPPERS:
            raise ValueError(f"messages[{i}]['role']={m.get('role')!r}; valid: {sorted(ROLE_WRAPPERS)}")
    if messages[-1]["role"] != "assistant":
        raise ValueError(f"messages[-1]['role']={messages[-1]['role']!r}; the last message must be the "
                         "assistant response")
    if max_blocks < 1:
        raise ValueError(f"max_blocks={max_blocks} must be >= 1")
    prompt = messages[:-1]
    groups = [_wrap(m["role"], split_by_delimiter(m["content"])) for m in prompt]
    if len(prompt) > 1:              # multi-turn: the last user message is one global block
        groups[-1] = _wrap(prompt[-1]["role"], [prompt[-1]["content"]])
    pieces = []   # per block: role prefix and suffix as markup (only where _wrap put them), the text as content
    for m, group in zip(prompt, merge_within_messages(groups, max_blocks, size)):
        prefix, suffix = ROLE_WRAPPERS[m["role"]]
        for j, chunk in enumerate(group):
            head, tail = prefix if j == 0 else "", suffix if j == len(group) - 1 else ""
            pieces.append([Markup(head), chunk[len(head):len(chunk) - len(tail)], Markup(tail)])
    pieces[-1].append(Markup(ASSISTANT_TAG))
    blocks = tuple(tuple(encode(tokenizer, *p)) for p in pieces)
    response = tuple(encode(tokenizer, messages[-1]["content"], Markup(END_OF_TEXT)))
    return BlockExample(blocks, response)


def _wrap(role: str, chunks: list[str]) -> list[str]:
    """Role prefix on the first chunk, suffix on the last (reference ``to_blocks``)."""
    prefix, suffix = ROLE_WRAPPERS[role]
    chunks = list(chunks)
    chunks[0] = prefix + chunks[0]
    chunks[-1] = chunks[-1] + suffix
    return chunks
