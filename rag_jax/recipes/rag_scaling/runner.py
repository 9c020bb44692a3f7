"""Prompts and model calls of DRAG and IterDRAG (Yue et al., ICLR 2025, §3) for a chat model, with every reply
cached on disk.

- **DRAG** (k, m): ``m`` demonstrations, each a training question with its documents and answer, before the ``k``
  documents retrieved for the question (best last, next to the question). Demonstrations are the same for every
  question, so Block-Attention caches them once (each is one block) while full attention re-encodes them.
- **IterDRAG** (k, m, n): up to ``n - 1`` sub-queries, each answered from its own top-``k`` documents, then the
  final answer with every document retrieved so far (question's and sub-queries', deduplicated, the latest last)
  and the self-ask chain as the start of the reply (``decompose``). ``oracle``: the sub-queries of the question's
  template (an upper bound, labelled as such; each sub-query answered DRAG-style with the ``m`` demonstrations);
  ``own``: the model writes them itself after ``m`` self-ask demonstrations, one call for the sub-query and one
  for its intermediate answer.
- Budget: the effective context length, all input tokens of all calls of a question (§3), per question.

Documents are dropped from the front (the oldest, lowest ranked), then demonstrations, when a prompt would not fit
the model's window with ``max_new_tokens``; ``Calls.truncated`` counts the prompts that lost any.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from rag_jax.data.chat_blocks import PASSAGE, ChatBlocks
from rag_jax.data.phantom_rag import answer_text
from rag_jax.evaluation.rag import generate_answers, memo_json, with_gold
from rag_jax.recipes.rag_scaling.decompose import (FINAL, FOLLOW_UP, INTERMEDIATE, Decomposition,
                                                   gold_intermediate_answers, oracle_decomposition, parse_self_ask,
                                                   self_ask_text)

Search = Callable[[Sequence[str], int], list[list[int]]]   # queries, k -> per query doc ids, best first


def drag_demonstration(question: str, documents: Sequence[str], answer: str) -> str:
    """One DRAG demonstration: its documents, the question and its answer (content text)."""
    return "".join(PASSAGE.format(text=d.strip()) for d in documents) + f"Question: {question}\nAnswer: {answer}\n\n"


def iter_demonstration(question: str, documents: Sequence[str], steps: Sequence[str], answers: Sequence[str],
                       final: str) -> str:
    """One IterDRAG demonstration: documents, question, then the self-ask chain and the final answer."""
    return ("".join(PASSAGE.format(text=d.strip()) for d in documents) + f"Question: {question}\n"
            + self_ask_text(steps, answers, final) + "\n\n")


@dataclasses.dataclass
class Calls:
    """The model calls of one configuration: replies per question, and per question its input tokens over all
    calls (``lengths``) and number of calls."""

    answers: list[str]
    lengths: list[int]
    calls: list[int]
    truncated: int = 0


class Runner:
    """Answers questions under DRAG / IterDRAG with one model, retriever and attention mode.

    Args:
      loaded: a ``LoadedModel`` with a chat template; ba: its ``BlockAttention`` (with a KV store for block mode).
      docs: the passages; search: the retriever over them.
      drag_demos / iter_demos: demonstration texts (``drag_demonstration`` / ``iter_demonstration``), first m used.
      cache: JSON file of replies keyed by a hash of (weights, mode, decoding, prompt ids); None: no cache.
      retriever: the retriever's name, for reports.
    """

    def __init__(self, loaded, ba, docs: Sequence[str], search: Search, *, drag_demos: Sequence[str],
                 iter_demos: Sequence[str], mode: str, max_new_tokens: int, batch_size: int, cache: Path | None,
                 fingerprint: str, retriever: str = ""):
        self.loaded, self.ba, self.docs, self.search = loaded, ba, list(docs), search
        self.chat = ChatBlocks(loaded)
        self.drag_demos, self.iter_demos = list(drag_demos), list(iter_demos)
        self.mode, self.max_new_tokens, self.batch_size = mode, max_new_tokens, batch_size
        self.cache, self.fingerprint, self.retriever = cache, fingerprint, retriever
        self.max_len = loaded.config.max_seq_len - max_new_tokens - 2 * ba.pad_multiple

    # -- prompts ---------------------------------------------------------------------------------------------
    def prompt(self, question: str, doc_ids: Sequence[int], demos_in: Sequence[str], reply_prefix: str = ""
               ) -> tuple[list[list[int]], bool]:
        """Prompt blocks (documents in the given order) fitted to the window, and whether anything was cut: the
        first documents go first, then the first demonstrations. Raises ValueError when the question and reply
        prefix alone do not fit."""
        ids, demos = list(doc_ids), list(demos_in)
        while True:
            blocks = self.chat.blocks(question, [self.docs[j] for j in ids], demonstrations=demos,
                                      reply_prefix=reply_prefix)
            if sum(map(len, blocks)) <= self.max_len:
                return blocks, len(ids) + len(demos) < len(doc_ids) + len(demos_in)
            if not ids and not demos:
                raise ValueError(f"question {question[:60]!r} with its reply prefix does not fit max_seq_len="
                                 f"{self.loaded.config.max_seq_len} with max_new_tokens={self.max_new_tokens}")
            ids, demos = (ids[1:], demos) if ids else (ids, demos[1:])

    def generate(self, prompts: Sequence[list[list[int]]]) -> list[str]:
        """Greedy replies, cached by (weights, mode, decoding, prompt)."""
        def key(blocks):
            text = json.dumps([self.fingerprint, self.mode, self.max_new_tokens, blocks])
            return hashlib.sha256(text.encode()).hexdigest()

        def compute(keys):
            todo = [by_key[k] for k in keys]
            return generate_answers(self.ba, self.loaded.tokenizer, todo, mode=self.mode,
                                    max_new_tokens=self.max_new_tokens, batch_size=self.batch_size,
                                    eos_id=self.loaded.eos_ids)

        keys = [key(p) for p in prompts]
        by_key = dict(zip(keys, prompts))
        return memo_json(self.cache, keys, compute)

    def _retrieve(self, queries: Sequence[str], k: int) -> list[list[int]]:
        return [[] for _ in queries] if k == 0 else [[int(j) for j in r if j >= 0] for r in self.search(queries, k)]

    # -- methods ---------------------------------------------------------------------------------------------
    def drag(self, questions: Sequence[str], k: int, m: int) -> Calls:
        """DRAG with ``k`` documents (best last) and ``m`` demonstrations."""
        made = [self.prompt(q, r[::-1], self.drag_demos[:m]) for q, r in zip(questions, self._retrieve(questions, k))]
        answers = self.generate([b for b, _ in made])
        return Calls(answers, [sum(map(len, b)) for b, _ in made], [1] * len(questions), sum(t for _, t in made))

    def iter_oracle(self, questions: Sequence[str], k: int, m: int, n: int) -> Calls:
        """IterDRAG with the template's sub-queries (at most ``n - 1``), each answered with k documents."""
        decs: list[Decomposition] = [oracle_decomposition(q) for q in questions]
        state = [{"docs": list(r)[::-1], "answers": [], "length": 0, "calls": 0}
                 for r in self._retrieve(questions, k)]
        truncated = 0
        for step in range(n - 1):
            live = [i for i, d in enumerate(decs) if step < len(d.steps)]
            if not live:
                break
            subs = [decs[i].fill(decs[i].steps[step], state[i]["answers"]) for i in live]
            made = []
            for i, sub, hits in zip(live, subs, self._retrieve(subs, k)):
                self._add(state[i]["docs"], hits)
                made.append(self.prompt(sub, hits[::-1], self.drag_demos[:m]))
            for i, (blocks, cut), reply in zip(live, made, self.generate([b for b, _ in made])):
                state[i]["answers"].append(reply.split("\n")[0].strip())
                state[i]["length"] += sum(map(len, blocks))
                state[i]["calls"] += 1
                truncated += cut
        finals = [d.fill(d.final, s["answers"]) for d, s in zip(decs, state)]
        made = []
        for d, s, q, f, hits in zip(decs, state, questions, finals, self._retrieve(finals, k)):
            self._add(s["docs"], hits)
            used = len(s["answers"])
            chain = self_ask_text([d.fill(x, s["answers"]) for x in d.steps[:used]], s["answers"]) + FINAL
            made.append(self.prompt(q, s["docs"], self.iter_demos[:m], chain))
        return self._finish(made, state, truncated)

    def iter_own(self, questions: Sequence[str], k: int, m: int, n: int) -> Calls:
        """IterDRAG with the model's own sub-queries: up to ``n - 1`` rounds of (sub-query, retrieval,
        intermediate answer), then the final answer."""
        state = [{"docs": list(r)[::-1], "chain": "", "done": None, "length": 0, "calls": 0}
                 for r in self._retrieve(questions, k)]
        truncated = 0
        for _ in range(n - 1):
            live = [i for i, s in enumerate(state) if s["done"] is None]
            if not live:
                break
            made = [self.prompt(questions[i], state[i]["docs"], self.iter_demos[:m], state[i]["chain"])
                    for i in live]
            truncated += self._charge(live, made, state)
            asked = []
            for i, reply in zip(live, self.generate([b for b, _ in made])):
                kind, text = parse_self_ask(reply)
                if kind == "final" or not text:
                    state[i]["done"] = text
                else:
                    asked.append((i, text))
            if not asked:
                break
            for (i, _), hits in zip(asked, self._retrieve([t for _, t in asked], k)):
                self._add(state[i]["docs"], hits)
            made = [self.prompt(questions[i], state[i]["docs"], self.iter_demos[:m],
                                f"{state[i]['chain']}{FOLLOW_UP}{t}\n{INTERMEDIATE}") for i, t in asked]
            truncated += self._charge([i for i, _ in asked], made, state)
            for (i, t), reply in zip(asked, self.generate([b for b, _ in made])):
                state[i]["chain"] += f"{FOLLOW_UP}{t}\n{INTERMEDIATE}{reply.split(chr(10))[0].strip()}\n"
        made = [self.prompt(q, s["docs"], self.iter_demos[:m], s["chain"] + FINAL) for q, s in zip(questions, state)]
        calls = self._finish(made, state, truncated)
        calls.answers = [s["done"] if s["done"] is not None else a for s, a in zip(state, calls.answers)]
        return calls

    # -- bookkeeping -----------------------------------------------------------------------------------------
    @staticmethod
    def _add(docs: list[int], hits: Sequence[int]) -> None:
        """Append ``hits`` (best first) so the best ends last; a document already there moves to its new place."""
        for j in hits[::-1]:
            if j in docs:
                docs.remove(j)
            docs.append(j)

    @staticmethod
    def _charge(live, made, state) -> int:
        for i, (blocks, _) in zip(live, made):
            state[i]["length"] += sum(map(len, blocks))
            state[i]["calls"] += 1
        return sum(cut for _, cut in made)

    def _finish(self, made, state, truncated: int) -> Calls:
        """The final call for the questions without an answer yet (IterDRAG-own's early finishers keep theirs)."""
        todo = [i for i, s in enumerate(state) if s.get("done") is None]
        replies = dict(zip(todo, self.generate([made[i][0] for i in todo])))
        truncated += self._charge(todo, [made[i] for i in todo], state)
        return Calls([replies.get(i, "") for i in range(len(state))], [s["length"] for s in state],
                     [s["calls"] for s in state], truncated)


def demonstrations(pool: Sequence[dict], docs: Sequence[str], search: Search, facts, num_docs: int
                   ) -> tuple[list[str], list[str]]:
    """DRAG and IterDRAG demonstration texts from training questions (``{"question", "answer", "gold",
    "prolog"}``): each with its gold passages first, then the best other retrieved ones, ``num_docs`` in all,
    best last; IterDRAG's self-ask chain from the template decomposition and gold intermediate answers."""
    ranked = search([q["question"] for q in pool], num_docs + 4)
    drag, iterative = [], []
    for q, r in zip(pool, ranked):
        texts = [docs[j] for j in with_gold([j for j in r if j >= 0], q["gold"], num_docs)][::-1]
        answer = answer_text(q["answer"])
        drag.append(drag_demonstration(q["question"], texts, answer))
        dec = oracle_decomposition(q["question"])
        golds = [answer_text(g) for g in gold_intermediate_answers(facts, q["prolog"]["query"], dec)]
        steps = [dec.fill(s, golds) for s in dec.steps]
        iterative.append(iter_demonstration(q["question"], texts, steps, golds, answer))
    return drag, iterative
