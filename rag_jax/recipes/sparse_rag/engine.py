"""Sparse RAG (Zhu et al., ICLR 2025, "Accelerating Inference of Retrieval-Augmented Generation via Sparse Context
Selection") on the Block-Attention passage cache.

Retrieved passages are encoded in parallel, each an independent cache (Block-Attention's KV reuse,
``inference.block_attention``). The model rates each cache with control tokens: one assessment per passage, the
prompt ``[instruction, passage, question + template tail, <|assess|>]`` read in block mode over the passage's
cached KV, and the rating is the next-token choice between ``<|relevant|>`` and ``<|irrelevant|>`` (the paper's
per-context assessment, §3.2; its silver labels here are the gold passage ids, §3.3). Decoding then attends only
to the caches kept (a threshold on P(relevant) or the top m, in prompt order): the answer prompt holds the kept
passages only, so every decoded token reads fewer cached keys (§3.4).

Deviation, stated: the paper rates all contexts in the same decoding pass as the answer; here the k assessments are
k short block-mode prefills of the question against each passage's own cache (each passage's KV is computed once
and reused by its assessment and by the answer), which needs no position bookkeeping for passage indices and
batches trivially.

The control tokens are new special tokens (``add_control_tokens``): their embedding rows start as the mean of the
rows of a few existing words' tokens (``INIT_WORDS``), as the paper initialises them; passages and questions are
content text, so "<|relevant|>" written in a passage stays text (``rag_jax.text``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import tokenizers
from flax import nnx

from rag_jax.data.block_rag import BlockExample
from rag_jax.data.chat_blocks import ChatBlocks
from rag_jax.inference.block_attention import BlockAttention
from rag_jax.text import encode_content

CONTROL_TOKENS = ("<|assess|>", "<|relevant|>", "<|irrelevant|>")
# Each new row: the mean of these phrases' token rows. Phrases of several tokens, so that no new row equals an
# existing token's row: with a tied output head left frozen (top-layer training) such a pair would always get
# equal logits, and the new token could never be more likely than the old one.
INIT_WORDS = ("Is the document relevant?", "Yes, relevant", "No, irrelevant")


def control_ids(tokenizer) -> tuple[int, int, int]:
    """Ids of ``CONTROL_TOKENS`` (assess, relevant, irrelevant). Raises ValueError if the tokenizer lacks one
    (``add_control_tokens`` adds them)."""
    ids = [tokenizer.token_to_id(t) for t in CONTROL_TOKENS]
    if None in ids:
        raise ValueError(f"tokenizer has no Sparse RAG control token {CONTROL_TOKENS[ids.index(None)]!r}; load a "
                         "model fine-tuned by `rag-jax eval sparse_rag` or call add_control_tokens first")
    return tuple(ids)


def add_control_tokens(loaded):
    """A copy of ``loaded`` (``LoadedModel``) whose tokenizer has ``CONTROL_TOKENS`` as special tokens and whose
    embedding (and untied output head) has their rows: the tokenizer's next free ids, appended to the model's
    vocabulary where they fall past it. Each new embedding row (and untied head column) is the mean of those of
    ``INIT_WORDS``' tokens. The other rows, and so every other token's logits, are unchanged.

    Raises:
      ValueError: the tokenizer has one of the tokens already, or more tokens than the model has rows.
    """
    tok = tokenizers.Tokenizer.from_str(loaded.tokenizer.to_str())
    if any(tok.token_to_id(t) is not None for t in CONTROL_TOKENS):
        raise ValueError(f"tokenizer of {loaded.source} already has a Sparse RAG control token {CONTROL_TOKENS}")
    cfg = loaded.config
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > cfg.vocab_size:
        raise ValueError(f"tokenizer of {loaded.source} has {size} tokens, the model {cfg.vocab_size} rows")
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    ids = [tok.token_to_id(t) for t in CONTROL_TOKENS]
    model = nnx.clone(loaded.model)                         # the caller's model untouched
    emb = np.asarray(model.embedding[...], np.float32)
    init = [loaded.tokenizer.encode(w, add_special_tokens=False).ids for w in INIT_WORDS]
    rows = [emb[i].mean(axis=0) for i in init]
    vocab = max(cfg.vocab_size, max(ids) + 1)
    new = np.zeros((vocab, emb.shape[1]), np.float32)
    new[:len(emb)] = emb
    new[ids] = rows
    model.embedding.set_value(new.astype(model.embedding[...].dtype))
    if not cfg.tie_embeddings:
        head = np.asarray(model.lm_head[...], np.float32)
        grown = np.zeros((head.shape[0], vocab), np.float32)
        grown[:, :head.shape[1]] = head
        grown[:, ids] = np.stack([head[:, i].mean(axis=1) for i in init], axis=1)
        model.lm_head.set_value(grown.astype(model.lm_head[...].dtype))
    model.config = cfg.replace(vocab_size=vocab)
    return dataclasses.replace(loaded, config=model.config, model=model, tokenizer=tok)


def keep(p_relevant: Sequence[float], *, top_m: int | None = None, threshold: float | None = None) -> list[int]:
    """Indices of the caches kept, in prompt order: the ``top_m`` most likely relevant (ties: the earlier), or
    those with P(relevant) >= ``threshold``. Raises ValueError unless exactly one of the two is given."""
    if (top_m is None) == (threshold is None):
        raise ValueError(f"give exactly one of top_m={top_m} and threshold={threshold}")
    p = np.asarray(p_relevant, np.float64)
    if top_m is not None:
        return sorted(int(i) for i in np.argsort(-p, kind="stable")[:top_m])
    return [int(i) for i in np.flatnonzero(p >= threshold)]


class SparseRAG:
    """Assessment and selective decoding for one model (module docstring).

    Args:
      loaded: a ``LoadedModel`` with a chat template and the control tokens (``add_control_tokens`` or a run
        folder fine-tuned with them).
      ba: its ``BlockAttention`` (with a ``KVStore``, so passage caches are shared by assessment and answer).

    Raises:
      ValueError: no chat template, or no control tokens.
    """

    def __init__(self, loaded, ba: BlockAttention):
        self.loaded, self.ba, self.chat = loaded, ba, ChatBlocks(loaded)
        self.assess_id, self.relevant_id, self.irrelevant_id = control_ids(loaded.tokenizer)

    def assessment_blocks(self, question: str, passage: str) -> list[list[int]]:
        """``[head + instruction, passage, question + template tail + <|assess|>]`` (the control token as its id,
        never parsed from text)."""
        blocks = self.chat.blocks(question, [passage])
        return [*blocks[:-1], blocks[-1] + [self.assess_id]]

    def assess(self, question: str, passages: Sequence[str]) -> np.ndarray:
        """float64 ``[k]``: P(relevant) of each passage, the softmax over the two rating tokens' logits after its
        assessment prompt (block mode over the passage's cache)."""
        out = []
        for passage in passages:
            logits = np.asarray(self.ba.prefill(self.assessment_blocks(question, passage), mode="block",
                                                last_only=True).logits, np.float64)[-1]
            z = logits[[self.relevant_id, self.irrelevant_id]]
            out.append(1.0 / (1.0 + np.exp(z[1] - z[0])))
        return np.array(out)

    def assessment_example(self, question: str, passage: str, relevant: bool) -> BlockExample:
        """A training example: the assessment prompt with its rating token (and the end of turn) as response."""
        rating = self.relevant_id if relevant else self.irrelevant_id
        return BlockExample(self.assessment_blocks(question, passage), [rating, self.loaded.eos_ids[0]])

    def answer_example(self, question: str, passages: Sequence[str], answer: str) -> BlockExample:
        """A training example: the RAG prompt of the kept ``passages`` with ``answer`` (content text) and the end of
        turn as response."""
        return BlockExample(self.chat.blocks(question, passages),
                            encode_content(self.loaded.tokenizer, answer) + [self.loaded.eos_ids[0]])
