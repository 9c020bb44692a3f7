"""GRIT embedding mode: the decoder as a text embedder (GritLM, Muennighoff et al., ICLR 2025, §2).

The same ``Transformer`` that generates also embeds: the embedding pass runs with
``mode="bidirectional"`` (a padding mask only, no causal mask), takes the final-norm hidden states,
mean-pools them over the *sample* tokens only — the format and instruction tokens
(``<s><|user|>\\n{instruction}\\n<|embed|>\\n``) are attended to but not pooled (§2, notes §3.3) —
and L2-normalizes, with pooling and normalization in float32 (§3.3, notes §3.4). Generation uses the
same weights with ``mode="causal"``.

Prompt formats (reference ``training/run.py`` constants, notes §3.1; the markers are plain text,
not special tokens):
- query with instruction: ``<s><|user|>\\n{instruction}\\n<|embed|>\\n{text}``
- document, no instruction: ``<s><|embed|>\\n{text}``
- generation (Tülu): ``<s>`` + ``"\\n".join(<|user|>\\n{u}\\n<|assistant|>\\n{a}</s>)``, loss on ``{a}</s>``.

The format prefix is markup and the sample text content (``rag_jax.text``: special-token text in a
corpus text stays text). Pool masks come from character offsets of the *joint* tokenization (a token counts as sample
text iff it starts at or after the end of the prefix), not from tokenizing the prefix separately as
the reference does, which can be off by a token (notes §3.3). Inputs are right-padded and
positions are ``0..len-1`` (notes §3.2).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rag_jax.model.config import ModelConfig
from rag_jax.model.transformer import ModelOutput, Transformer
from rag_jax.text import Markup, encode_pieces


@dataclasses.dataclass(frozen=True)
class GritFormat:
    """GRIT prompt strings (defaults: the reference's Mistral/Tülu constants, notes §3.1).

    ``bos``/``eos`` should be the tokenizer's BOS/EOS *text* (registered special tokens are matched
    inside text by ``tokenizers``); the ``<|user|>`` style markers are ordinary text.
    """

    bos: str = "<s>"
    eos: str = "</s>"
    user: str = "<|user|>\n"
    embed: str = "\n<|embed|>\n"
    assistant: str = "\n<|assistant|>\n"
    turn_sep: str = "\n"

    def embed_prefix(self, instruction: str = "") -> str:
        """Text before the sample: ``<s><|user|>\\n{instruction}\\n<|embed|>\\n`` or ``<s><|embed|>\\n``."""
        if instruction:
            return self.bos + self.user + instruction + self.embed
        return self.bos + self.embed.lstrip("\n")

    def generation(self, turns: list[str]) -> tuple[str, list[tuple[int, int]]]:
        """Format ``[user1, assistant1, user2, assistant2, ...]`` (Tülu format).

        Returns ``(text, spans)``: the full prompt and the character spans ``[start, end)`` of every
        ``{assistant}</s>`` piece (the generative loss targets, paper Eq. 2).

        Raises:
          ValueError: odd number of turns, no turns, or an empty turn.
        """
        pieces, spans = self.generation_pieces(turns)
        return "".join(pieces), spans

    def generation_pieces(self, turns: list[str]) -> tuple[list[str], list[tuple[int, int]]]:
        """``generation`` as prompt pieces (``rag_jax.text``): the format's markers as ``Markup``, the turns as
        content; ``"".join(pieces)`` is ``generation``'s text. Same spans and errors."""
        if not turns or len(turns) % 2:
            raise ValueError(f"generative 'text' must be [user, assistant, user, assistant, ...] with an even, "
                             f"non-zero number of turns; got {len(turns)} turns")
        pieces, spans, at = [Markup(self.bos)], [], len(self.bos)
        for i in range(0, len(turns), 2):
            user, answer = turns[i], turns[i + 1].strip()
            if not user.strip() or not answer:
                raise ValueError(f"generative turn pair {i // 2} has an empty user or assistant text: "
                                 f"{turns[i]!r}, {turns[i + 1]!r}")
            head = (self.turn_sep if i else "") + self.user
            pieces += [Markup(head), user, Markup(self.assistant), answer, Markup(self.eos)]
            at += len(head) + len(user) + len(self.assistant)
            spans.append((at, at + len(answer) + len(self.eos)))
            at += len(answer) + len(self.eos)
        return pieces, spans


def _encode(tokenizer, prefix: str, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of ``prefix + text``: the prefix is the format's markup (its BOS is
    the special token), the sample text is content (special-token text in it stays text; ``rag_jax.text``)."""
    enc = encode_pieces(tokenizer, [Markup(prefix), text])
    return enc.ids, enc.offsets


def tokenize_for_embedding(tokenizer, text: str, instruction: str = "", *, max_len: int,
                           fmt: GritFormat = GritFormat(), prefix: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize one embedding input in the GRIT format, truncated to ``max_len`` tokens.

    Args:
      tokenizer: a ``tokenizers.Tokenizer``.
      text: the sample (query or document) text; must be non-empty.
      instruction: task instruction (queries) or ``""`` (documents, notes §2: one-sided instructions).
      max_len: maximum tokens, including the format/instruction prefix.
      prefix: overrides ``fmt.embed_prefix(instruction)`` (GRIT query-doc caching embeds the doc after
        ``"\n<|embed|>\n"`` without BOS, paper §4).

    Returns:
      ``(ids int32 [n], pool_mask int32 [n])`` with ``n <= max_len``; ``pool_mask`` is 1 on sample tokens.

    Raises:
      ValueError: empty text, or a prefix (format + instruction) that leaves no room for the sample
        within ``max_len`` (the reference drops such samples, notes §2).
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"embedding text must be a non-empty string; got {text!r}")
    prefix = fmt.embed_prefix(instruction) if prefix is None else prefix
    ids, offsets = _encode(tokenizer, prefix, text)
    pool = [1 if start >= len(prefix) else 0 for start, _ in offsets]
    n_prefix = len(pool) - sum(pool)
    if n_prefix >= max_len:
        raise ValueError(f"instruction/format prefix {prefix!r} is {n_prefix} tokens, which leaves no sample token "
                         f"within max_len={max_len}; shorten the instruction or raise max_len above {n_prefix}")
    if sum(pool) == 0:
        raise ValueError(f"text {text!r} produced no tokens after the prefix")
    return np.asarray(ids[:max_len], np.int32), np.asarray(pool[:max_len], np.int32)


def check_bidirectional_window(cfg: ModelConfig, seq_len: int) -> None:
    """Refuse an embedding pass that a sliding window would cut (notes §3.2: no window with the
    bidirectional mask; the core forward applies ``cfg.sliding_window`` in every mode)."""
    if cfg.sliding_window is not None and seq_len > cfg.sliding_window:
        raise ValueError(f"embedding sequence length {seq_len} exceeds sliding_window={cfg.sliding_window}; the "
                         "bidirectional pass must not use a window; use max_len <= sliding_window")


def mean_pool_normalize(hidden: jax.Array, pool_mask: jax.Array) -> jax.Array:
    """Mean over pooled tokens then L2 normalization, in float32 (paper §3.3).

    hidden ``[batch, seq, hidden]`` (any float dtype), pool_mask ``[batch, seq]`` (1 = pool)
    -> float32 ``[batch, hidden]`` with unit L2 norm (all-zero rows for rows with nothing pooled).
    """
    m = pool_mask.astype(jnp.float32)
    total = jnp.einsum("bsh,bs->bh", hidden.astype(jnp.float32), m)
    mean = total / jnp.maximum(m.sum(axis=1, keepdims=True), 1.0)
    norm = jnp.sqrt(jnp.sum(mean * mean, axis=-1, keepdims=True))
    return mean / jnp.maximum(norm, 1e-12)


def encode(model: Transformer, tokens: jax.Array, attention_mask: jax.Array, pool_mask: jax.Array, *,
           mode: str = "bidirectional", inputs_embeds: jax.Array | None = None) -> tuple[jax.Array, ModelOutput]:
    """The embedding pass.

    Args:
      tokens: int32 ``[batch, seq]``, right-padded.
      attention_mask: int ``[batch, seq]``, 1 on real tokens (used as ``segment_ids``).
      pool_mask: int ``[batch, seq]``, 1 on sample tokens (subset of ``attention_mask``).
      mode: ``"bidirectional"`` (GRIT) or ``"causal"`` (ablation / exact-cache check).
      inputs_embeds: optional ``[batch, seq, hidden]`` first-layer input instead of the token embeddings
        (a frozen bottom's output, ``rag_jax.train.frozen_bottom``).

    Returns:
      ``(reps float32 [batch, hidden_size] unit-norm, ModelOutput)``; ``ModelOutput.kv`` is the
      KV of this pass (GRIT doc/query caching, paper §4).
    """
    check_bidirectional_window(model.config, tokens.shape[1])
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    segment_ids = attention_mask.astype(jnp.int32)
    out = model(tokens, positions, segment_ids, mode=mode, inputs_embeds=inputs_embeds)
    return mean_pool_normalize(out.hidden, pool_mask * segment_ids), out


def pad_length(n: int, minimum: int = 16) -> int:
    """Pad lengths to powers of two so a stream of batches compiles a handful of shapes."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


class GritEmbedder:
    """``Embedder`` (rag_jax.retrieval protocol) over a rag-jax decoder in GRIT embedding mode.

    ``embed(texts) -> float32 [n, dim]`` unit-norm rows, ``dim = hidden_size``. Queries get the
    instruction, documents none (notes §2): use one embedder per side or pass ``instruction=``.

    Args:
      model: a ``Transformer`` or its ``(graphdef, state)`` from ``nnx.split``.
      tokenizer: a ``tokenizers.Tokenizer``.
      instruction: default instruction (``""`` = document format).
      max_length: tokens per input incl. prefix (inputs are truncated; reference eval uses 512).
      batch_size: inputs per forward.
      fmt: prompt strings (``GritFormat`` or ``rag_jax.data.grit.ChatGritFormat``).
      inputs_embeds: optional ``(tokens, attention_mask) -> float [batch, seq, hidden]``, the first-layer inputs of
        a padded batch instead of the token embeddings: with a top model of ``rag_jax.train.frozen_bottom``, the
        frozen bottom's cached output (``lambda t, m: frozen.inputs_embeds("bidirectional", t, m)``).
    """

    def __init__(self, model, tokenizer, *, instruction: str = "", max_length: int = 512, batch_size: int = 32,
                 fmt: GritFormat = GritFormat(), inputs_embeds=None):
        if isinstance(model, Transformer):
            model = nnx.split(model)
        self._graphdef, self._state = model
        cfg = nnx.merge(self._graphdef, self._state).config
        if max_length < 2 or max_length > cfg.max_seq_len:
            raise ValueError(f"max_length={max_length} must be in [2, max_seq_len={cfg.max_seq_len}] tokens")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        check_bidirectional_window(cfg, max_length)
        self.tokenizer, self.instruction, self.fmt = tokenizer, instruction, fmt
        self.max_length, self.batch_size, self.inputs_embeds = max_length, batch_size, inputs_embeds
        self.dim = cfg.hidden_size
        graphdef = self._graphdef

        @jax.jit
        def _embed(state, tokens, attention_mask, pool_mask, x):
            return encode(nnx.merge(graphdef, state), tokens, attention_mask, pool_mask, inputs_embeds=x)[0]

        self._embed = _embed

    def embed(self, texts: list[str], instruction: str | None = None) -> np.ndarray:
        """Embed ``texts`` -> float32 ``[len(texts), dim]``, L2-normalized.

        All texts are tokenized (and validated) before any compute; batches are formed in length order
        and padded to power-of-two lengths and row counts (few compiled shapes, little padding).

        Raises:
          ValueError: an empty text or an instruction that does not fit ``max_length``.
        """
        texts = list(texts)
        out = np.zeros((len(texts), self.dim), np.float32)
        instr = self.instruction if instruction is None else instruction
        rows = [tokenize_for_embedding(self.tokenizer, t, instr, max_len=self.max_length, fmt=self.fmt)
                for t in texts]
        order = np.argsort([len(ids) for ids, _ in rows], kind="stable")
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            width = min(pad_length(max(len(rows[i][0]) for i in chunk)), self.max_length)
            height = min(self.batch_size, pad_length(len(chunk), 1))
            tokens, attn, pool = (np.zeros((height, width), np.int32) for _ in range(3))
            for r, i in enumerate(chunk):
                ids, pm = rows[i]
                tokens[r, :len(ids)], attn[r, :len(ids)], pool[r, :len(ids)] = ids, 1, pm
            x = None if self.inputs_embeds is None else self.inputs_embeds(tokens, attn)
            out[chunk] = np.asarray(self._embed(self._state, tokens, attn, pool, x))[:len(chunk)]
        return out
