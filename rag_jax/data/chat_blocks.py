"""A chat model's RAG prompt as Block-Attention blocks (Ma et al., ICLR 2025, §2.1 RAG layout: system block, one
block per passage, global last block).

The chat template is rendered around one user message; the text before the message (system turn + user tag) plus
the instruction is block 0, every passage is a block, and the question with the rest of the template (end of
turn + assistant tag) is the global last block. Every block is tokenized on its own, so full and block mode see
the same ids, by the one prompt rule of ``rag_jax.text``: the template's text is markup (its special tokens
parsed), passages and the question are content (a passage holding ``<|im_start|>`` stays text).
Used by the demo's real-model track and the evaluations of pretrained chat models (``block_nq``,
``block_distill``, ``grit_pretrained``).
"""
from __future__ import annotations

from collections.abc import Sequence

from rag_jax.text import chat_pieces, encode_content, encode_pieces

INSTRUCTION = "Answer the question using the documents below. Reply with the answer only.\n\n"
PASSAGE = "Document: {text}\n\n"
QUESTION = "Question: {question}"

class ChatBlocks:
    """Chat-template prompt blocks for one loaded model (module docstring).

    Args:
      loaded: a ``rag_jax.model.load.LoadedModel`` with a tokenizer and a chat template.

    Raises:
      ValueError: the model has no tokenizer or no chat template, or the template drops the message.
    """

    def __init__(self, loaded):
        if loaded.tokenizer is None or loaded.chat_template is None:
            raise ValueError(f"model {loaded.source} needs a tokenizer and a chat template for the demo's "
                             "real-model track")
        try:
            self.head, _, self.tail = chat_pieces(loaded.chat_template, [{"role": "user", "content": "x"}],
                                                  **loaded.special_tokens)
        except ValueError as e:
            raise ValueError(f"chat template of {loaded.source}: {e}") from None
        self.tokenizer = loaded.tokenizer

    def blocks(self, question: str, passages: Sequence[str], *, demonstrations: Sequence[str] = (),
               reply_prefix: str = "") -> list[list[int]]:
        """``[head + instruction, demonstration_1, ..., demonstration_m, passage_1, ..., passage_k, question +
        template tail + reply_prefix]`` as token ids; the template's head and tail are markup, everything else
        content (``demonstrations``: in-context examples already written out, one block each, as DRAG puts
        them before the documents; ``reply_prefix``: the start of the assistant's reply, e.g. IterDRAG's
        earlier sub-queries and answers)."""
        return [encode_pieces(self.tokenizer, [self.head, INSTRUCTION]).ids,
                *[encode_content(self.tokenizer, d) for d in demonstrations],
                *[encode_content(self.tokenizer, PASSAGE.format(text=p.strip())) for p in passages],
                encode_pieces(self.tokenizer, [QUESTION.format(question=question), self.tail, reply_prefix]).ids]
