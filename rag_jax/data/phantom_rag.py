"""The PhantomWiki RAG task: passages, questions, prompts and the training rows of GRIT + Block-Attention.

Data (used by ``rag-jax demo``, ``train/pretrain_reader.py`` and the RAG evaluations):

- **Universes**: a PhantomWiki-style universe (``rag_jax.data.phantom.generate_universe``) for training and
  a held-out one (seed + 1: new people, new facts); or one PhantomWiki-format folder
  (``rag_jax.data.loaders.load_phantomwiki``) whose questions are split into train / held-out. The default
  task is 1-hop attribute questions ("What is the hobby of Ada Lee?"), whose answer is a span of the
  person's article.
- **Passages**: articles cut into one passage per section (``# Name`` + ``## Family`` / ``## Friends`` /
  ``## Attributes``), the usual RAG chunking; a question's gold passages are the sections that state the
  facts its Prolog query reads.
- **Prompts**: ``[passage blocks..., "Question: ...\nAnswer:"] -> " answer<eos>"``, one Block-Attention
  block per passage (Block-Attention, ICLR 2025, §2.2).
- **Training rows** (:class:`RagTrainingSet`): step-indexed grain streams of GRIT triples (query, gold
  passage, hard negatives; GritLM §2) and RAG block rows.
"""
from __future__ import annotations

import dataclasses
import os
import random
import re
from collections.abc import Sequence

import numpy as np

from rag_jax.data.block_rag import BlockExample, build_rag_example, collate, encode
from rag_jax.data.grit import GritDataConfig, embedding_dataset
from rag_jax.data.loaders import load_phantomwiki
from rag_jax.data.phantom import generate_universe
from rag_jax.model.embedding import GritFormat
from rag_jax.text import Markup
from rag_jax.tokenizer import BOS, EOS

QUESTION_FORMAT = "Question: {question}\nAnswer:"
GRIT_INSTRUCTION = "Find the article that answers the question"  # GRIT query instruction (documents: none)
ATTRIBUTE_PREDICATES = ("dob", "job", "hobby", "gender")
QUESTION_KINDS = ("auto", "attribute", "evidence", "all")

@dataclasses.dataclass(frozen=True)
class UniverseConfig:
    """Generated universes (unused with ``--data``): training universe ``seed``, held-out ``seed + 1``.

    Attributes:
      num_people / num_questions: training universe size (PhantomWiki generator arguments).
      heldout_people / heldout_questions: held-out universe size.
      max_hops: questions have 1..max_hops predicates.
      seed: training universe seed.
      friend_degree / max_family_size: PhantomWiki's mean friend count and family-tree size.
    """

    num_people: int = 300
    num_questions: int = 2000
    heldout_people: int = 100
    heldout_questions: int = 800
    max_hops: int = 1
    seed: int = 0
    friend_degree: float = 3.0
    max_family_size: int = 50


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """Which questions, and how many retrieved passages per prompt.

    Attributes:
      questions: ``attribute`` (1-hop "What is the <attribute> of <name>?"), ``evidence`` (every
        answer is written in the gold passages, which fit in ``num_passages``), ``all``, or ``auto``
        (attribute for generated universes, evidence with ``--data``).
      max_hops: keep questions with at most this many hops.
      num_passages: retrieved passages per prompt (k); each is one Block-Attention block.
      heldout_fraction: with ``--data``, the fraction of (selected) questions held out for evaluation.
      split_seed: seed of that split.
    """

    questions: str = "auto"
    max_hops: int = 2
    num_passages: int = 2
    heldout_fraction: float = 0.25
    split_seed: int = 0

    def __post_init__(self):
        if self.questions not in QUESTION_KINDS:
            raise ValueError(f"task.questions={self.questions!r}; valid: {QUESTION_KINDS}")
        if self.max_hops < 1 or self.num_passages < 1:
            raise ValueError(f"task.max_hops={self.max_hops} and task.num_passages={self.num_passages} must be >= 1")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"task.heldout_fraction={self.heldout_fraction} must be in (0, 1)")




# Article section that states each PhantomWiki query predicate (official article layout: # Name /
# ## Family / ## Friends / ## Attributes; union predicates as in rules_base.pl).
SECTION_OF_PREDICATE = {
    **{p: "Family" for p in ("sister", "brother", "mother", "father", "son", "daughter", "wife", "husband",
                             "parent", "child", "sibling", "married")},
    "friend": "Friends", **{p: "Attributes" for p in ATTRIBUTE_PREDICATES},
}


@dataclasses.dataclass
class RagData:
    """Passages (``{"title", "section", "text"}``: one per article section) and questions
    (``{"id", "question", "answer": [str], "hops", "titles": [str], "gold": [passage index]}``) of the
    training and the held-out side; with ``--data`` both sides share one universe's passages."""

    source: str
    train_passages: list[dict]
    eval_passages: list[dict]
    train_questions: list[dict]
    eval_questions: list[dict]
    question_kind: str
    num_articles: tuple[int, int]


def split_article(title: str, article: str) -> list[dict]:
    """An article -> one passage per non-empty ``## Section``, each headed by the article's ``# Title``
    line (so a passage names its person). Text without sections is one passage."""
    parts = re.split(r"\n\s*\n(?=## )", article.strip())
    head = parts[0].strip() if parts[0].startswith("# ") else f"# {title}"
    out = []
    for part in parts[1:] if len(parts) > 1 else []:
        lines = part.strip().split("\n")
        if len(lines) > 1:
            out.append({"title": title, "section": lines[0][3:].strip(), "text": f"{head}\n{part.strip()}\n"})
    if not out:
        body = article.strip()
        out.append({"title": title, "section": "",
                    "text": (body if body.startswith("# ") else f"{head}\n{body}") + "\n"})
    return out


def _query_sections(q: dict) -> set[str] | None:
    """Sections that state the predicates of the question's Prolog query (None: unknown)."""
    query = (q.get("prolog") or {}).get("query")
    if not query:
        return None
    preds = {m for atom in query for m in re.findall(r"([a-z_]+)\(", atom)} - {"aggregate_all", "distinct"}
    sections = {SECTION_OF_PREDICATE.get(p) for p in preds}
    return None if None in sections else sections


def _is_attribute_question(q: dict) -> bool:
    """1-hop ``<attribute>("<name>", Y)``: the answer is the value written in that person's article."""
    query = (q.get("prolog") or {}).get("query") or []
    return len(query) == 1 and re.match(r'^\s*(%s)\(\s*"' % "|".join(ATTRIBUTE_PREDICATES), query[0]) is not None


def _answer_in(answer: str, text: str) -> bool:
    return re.search(r"(?<![\w-])" + re.escape(answer) + r"(?![\w-])", text) is not None


def select_questions(questions: Sequence[dict], passages: Sequence[dict], kind: str, max_hops: int,
                     num_passages: int) -> list[dict]:
    """Questions of ``kind`` (``TaskConfig.questions``, resolved) with at most ``max_hops`` hops and gold
    titles naming existing articles, each with ``"gold"``: the passages that state the facts its query
    reads (the query predicates' sections of the gold articles; all their passages when the query is
    unknown). ``evidence`` also needs every answer written in those passages and at most
    ``num_passages`` of them."""
    by_title: dict[str, list[int]] = {}
    for i, p in enumerate(passages):
        by_title.setdefault(p["title"], []).append(i)
    out = []
    for q in questions:
        titles = q.get("titles")
        if not titles or q["hops"] > max_hops or any(t not in by_title for t in titles):
            continue
        if kind == "attribute" and not _is_attribute_question(q):
            continue
        sections = _query_sections(q)
        gold = [i for t in titles for i in by_title[t] if sections is None or passages[i]["section"] in sections]
        if not gold:
            continue
        if kind == "evidence":
            text = "\n".join(passages[i]["text"] for i in gold)
            if len(gold) > num_passages or not all(_answer_in(a, text) for a in q["answer"]):
                continue
        out.append({**q, "gold": gold})
    return out


def as_dicts(articles, questions) -> tuple[list[dict], list[dict]]:
    """``rag_jax.data.loaders`` records -> the plain dicts of ``generate_universe`` (the demo's format)."""
    arts = [{"title": a.title, "article": a.article} for a in articles]
    qs = [{"id": q.id, "question": q.question, "answer": list(q.answer), "hops": q.hops,
           "titles": list(q.titles) if q.titles is not None else None, "prolog": q.prolog} for q in questions]
    return arts, qs


def article_passages(articles: Sequence[dict]) -> list[dict]:
    """Every article's section passages (``split_article``), in article order."""
    return [p for a in articles for p in split_article(a["title"], a["article"])]


def prepare_data(universe: UniverseConfig, task: TaskConfig, data_path: str | os.PathLike | None = None) -> RagData:
    """Generate (or load) the universe(s), cut articles into passages, select and split the questions
    (module docstring, "Universes").

    Raises:
      FileNotFoundError: ``data_path`` (or one of its JSON files) does not exist.
      ValueError: a malformed dataset file (names the file, record and field), or too few questions
        of the selected kind for training and evaluation.
    """
    if data_path is None:
        u = universe
        kind = "attribute" if task.questions == "auto" else task.questions
        common = dict(max_hops=u.max_hops, friend_degree=u.friend_degree, max_family_size=u.max_family_size)
        train_u = generate_universe(u.num_people, u.seed, num_questions=u.num_questions, **common)
        eval_u = generate_universe(u.heldout_people, u.seed + 1, num_questions=u.heldout_questions, **common)
        train_p, eval_p = article_passages(train_u.articles), article_passages(eval_u.articles)
        train_q = select_questions(train_u.questions, train_p, kind, task.max_hops, task.num_passages)
        eval_q = select_questions(eval_u.questions, eval_p, kind, task.max_hops, task.num_passages)
        source = (f"generated universes: train seed {u.seed} ({u.num_people} people), "
                  f"held-out seed {u.seed + 1} ({u.heldout_people} people)")
        counts = (len(train_u.articles), len(eval_u.articles))
    else:
        kind = "evidence" if task.questions == "auto" else task.questions
        data = load_phantomwiki(data_path)
        articles, questions = as_dicts(data.articles, data.questions)
        train_p = eval_p = article_passages(articles)
        selected = select_questions(questions, train_p, kind, task.max_hops, task.num_passages)
        random.Random(task.split_seed).shuffle(selected)
        n_eval = max(1, round(len(selected) * task.heldout_fraction)) if selected else 0
        eval_q, train_q = selected[:n_eval], selected[n_eval:]
        source = f"PhantomWiki folder {data_path} ({len(articles)} articles, {len(questions)} questions)"
        counts = (len(articles), len(articles))
    if len(train_q) < 2 or not eval_q:
        raise ValueError(f"only {len(train_q)} training and {len(eval_q)} held-out questions of kind {kind!r} with "
                         f"<= {task.max_hops} hops (and <= task.num_passages={task.num_passages} gold passages); "
                         "set task.questions=all, raise task.max_hops or generate more questions")
    return RagData(source, train_p, eval_p, train_q, eval_q, kind, counts)




def grit_format():
    """GRIT prompt strings with this project's BPE special tokens (``<bos>``/``<eos>``)."""
    return GritFormat(bos=BOS, eos=EOS)


# ---------------------------------------------------------------------------------------------
# Prompts.

def passage_text(title: str, text: str) -> str:
    """A passage from another corpus (e.g. NQ) in the demo's layout: ``# Title`` line, then the text."""
    return f"# {title}\n{text.strip()}\n"


def question_block(question: str) -> str:
    return QUESTION_FORMAT.format(question=question)


def rag_example(tokenizer, question: str, passages: Sequence[str], answer: str | None = None):
    """A ``BlockExample``: one block per passage, the question block last, response ``" " + answer + <eos>``
    (``rag_jax.data.block_rag.build_rag_example`` with the demo's minimal template; no system block)."""
    return build_rag_example(tokenizer, question, [{"title": "", "text": p} for p in passages],
                             response=" " + answer if answer else "", system="", passage_format="{text}",
                             last_format=QUESTION_FORMAT, response_suffix=EOS)


def turns_block(turns: Sequence[tuple[Sequence[int], Sequence[int]]], newline: Sequence[int],
                question: Sequence[int], room: int | None = None) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """The last block of a multi-turn RAG row: answered ``(question ids, answer ids)`` turns, each followed by
    ``newline``, then the open ``question``. Turns are added while they fit in ``room`` tokens (None: all).

    Returns ``(block ids, answer spans)``: each earlier answer's ``[start, end)`` within the block (loss targets).
    """
    last, spans = (), []
    for q, a in turns:
        piece = tuple(q) + tuple(a) + tuple(newline)
        if room is not None and len(piece) > room:
            break
        spans.append((len(last) + len(q), len(last) + len(q) + len(a)))
        last = last + piece
        room = None if room is None else room - len(piece)
    return last + tuple(question), spans


def weighted_rag_batch(rows, seq_len: int, *, answer_weight: float = 1.0, passage_weight: float = 0.0):
    """Collate ``(BlockExample, answer spans of its last block)`` rows (``block_rag.collate``) with a per-token
    ``loss_mask``: ``answer_weight`` on the response and the earlier answers, ``passage_weight`` on passage
    tokens (next-token loss on the documents), 0 on the question tokens."""
    batch = collate([ex for ex, _ in rows], seq_len)
    for r, (ex, spans) in enumerate(rows):
        start = sum(len(b) for b in ex.blocks[:-1])
        for a, b in spans:
            batch["loss_mask"][r, start + a:start + b] = 1.0
    passage = (batch["segment_ids"] > 0) & ~batch["is_global"]
    batch["loss_mask"] = np.where(batch["loss_mask"] > 0, answer_weight,
                                  np.where(passage, passage_weight, 0.0)).astype(np.float32)
    return batch


def answer_text(answers: Sequence[str]) -> str:
    """Answer set -> the response string (PhantomWiki's comma-separated form)."""
    return ", ".join(answers)



# ---------------------------------------------------------------------------------------------
# Training rows.

def hard_negatives(passages: Sequence[dict]) -> list[list[int]]:
    """Per passage: the passages a retriever confuses with it — the other sections of the same article,
    then other people's passages that mention its title (as family or friend). Linear in the text:
    titles are looked up by their first word at every word of every passage."""
    by_title: dict[str, list[int]] = {}
    for i, p in enumerate(passages):
        by_title.setdefault(p["title"], []).append(i)
    by_first: dict[str, list[str]] = {}
    for t in by_title:
        by_first.setdefault(t.split(" ", 1)[0], []).append(t)
    mentions: dict[str, list[int]] = {t: [] for t in by_title}
    for i, p in enumerate(passages):
        text, found = p["text"], set()
        for m in re.finditer(r"[^\s,.]+", text):
            for t in by_first.get(m.group(), ()):
                if t != p["title"] and text.startswith(t, m.start()):
                    found.add(t)
        for t in sorted(found):
            mentions[t].append(i)
    return [[j for j in by_title[p["title"]] if j != i] + mentions[p["title"]] for i, p in enumerate(passages)]


class RagTrainingSet:
    """Tokenized training set and the two step-indexed grain streams (GRIT triples, RAG block rows).

    A RAG row is ``[passage blocks..., last block] -> answer`` with the question's gold passage(s) among
    ``task.num_passages`` passages (hard negatives and random ones, shuffled: the retriever's top k at
    test time may miss the gold passage and has no fixed order). The last block may first hold up to
    ``joint.max_turns - 1`` answered questions about the same passages (``Question: ...`` /
    ``Answer: ...<eos>`` turns, answer tokens weighted 1 like the response): more answers to learn from per encoded
    passage, which a model trained from scratch needs. Rows with a single question (the inference
    layout) are as frequent as any other turn count.

    Args:
      data: the task's passages and questions (:func:`prepare_data`).
      tokenizer: a ``tokenizers.Tokenizer`` with the ``<pad>``/``<bos>``/``<eos>`` tokens.
      fmt: GRIT prompt format (:func:`grit_format`).
      joint: the demo's ``joint`` section (``rag_jax.recipes.rag_demo.config.JointConfig``): batch sizes,
        ``group_size``, ``seq_len``/``query_max_len``/``passage_max_len`` (0 = from the data), ``lm_weight``,
        ``max_turns``, ``grit_instruction``.
      num_passages: passages per RAG row (the retriever's k).
      seed: data order and distractor sampling (the demo's ``train.seed``).

    Raises:
      ValueError: fewer than ``max(2, embedding_batch_size)`` questions fit ``seq_len`` with their gold passages.
    """

    def __init__(self, data: RagData, tokenizer, fmt, joint, num_passages: int, seed: int):
        import grain

        tc, k = joint, num_passages
        texts = [p["text"] for p in data.train_passages]
        tokens = [tuple(encode(tokenizer, t)) for t in texts]
        lengths = np.asarray([len(t) for t in tokens])
        negatives = hard_negatives(data.train_passages)
        q_tokens = [tuple(encode(tokenizer, question_block(q["question"]))) for q in data.train_questions]
        a_tokens = [tuple(encode(tokenizer, " " + answer_text(q["answer"]), Markup(EOS))) for q in data.train_questions]
        newline = tuple(encode(tokenizer, "\n"))
        q_len, a_len = max(map(len, q_tokens)), max(map(len, a_tokens))
        self.answer_tokens = a_len
        p90 = int(np.percentile(lengths, 90))
        turn = int(np.percentile([len(x) + len(y) for x, y in zip(q_tokens, a_tokens)], 90)) + len(newline)
        self.seq_len = tc.seq_len or -(-(k * p90 + q_len + a_len + (tc.max_turns - 1) * turn) // 32) * 32
        prefix = len(encode(tokenizer, Markup(fmt.embed_prefix(""))))
        self.passage_max_len = tc.passage_max_len or -(-(p90 + prefix) // 16) * 16
        longest = max(len(encode(tokenizer, Markup(fmt.embed_prefix(tc.grit_instruction)), q["question"]))
                      for q in data.train_questions)
        self.query_max_len = tc.query_max_len or -(-longest // 8) * 8
        budget = self.seq_len - q_len - a_len
        keep = [j for j, q in enumerate(data.train_questions) if lengths[q["gold"]].sum() <= budget]
        self.questions = [data.train_questions[j] for j in keep]
        q_tokens, a_tokens = [q_tokens[j] for j in keep], [a_tokens[j] for j in keep]
        if len(self.questions) < max(2, tc.embedding_batch_size):
            raise ValueError(f"only {len(self.questions)} training questions fit joint.seq_len={self.seq_len} tokens "
                             f"with their gold passages; need >= {max(2, tc.embedding_batch_size)} "
                             "(raise joint.seq_len or lower joint.embedding_batch_size)")
        self.dropped = len(data.train_questions) - len(self.questions)
        by_passage: dict[int, list[int]] = {}
        for j, q in enumerate(self.questions):
            for g in q["gold"]:
                by_passage.setdefault(g, []).append(j)
        lm_weight, max_turns = tc.lm_weight, tc.max_turns

        def rag_row(j: int, rng: np.random.Generator):
            q = self.questions[j]
            chosen, room = list(q["gold"]), budget - int(lengths[q["gold"]].sum())
            hard, rand = rng.permutation(negatives[q["gold"][0]]), rng.permutation(len(texts))
            candidates = [int(i) for pair in zip(hard, rand) for i in pair] + [int(i) for i in rand[len(hard):]]
            for i in candidates:
                if len(chosen) == k:
                    break
                if i not in chosen and lengths[i] <= room:
                    chosen.append(i)
                    room -= int(lengths[i])
            rng.shuffle(chosen)
            answerable = {o for i in chosen for o in by_passage.get(i, ()) if o != j
                          and set(self.questions[o]["gold"]) <= set(chosen)}
            others = rng.permutation(sorted(answerable))[:rng.integers(max_turns)]
            room = self.seq_len - int(lengths[chosen].sum()) - len(q_tokens[j]) - len(a_tokens[j])
            last, spans = turns_block([(q_tokens[o], a_tokens[o]) for o in others], newline, q_tokens[j], room)
            return BlockExample(tuple(tokens[i] for i in chosen) + (last,), a_tokens[j]), spans

        def rag_batch(rows):  # answers of the earlier turns are targets too; passage tokens weigh lm_weight
            return weighted_rag_batch(rows, self.seq_len, passage_weight=lm_weight)  # passage tokens: next-token loss on the documents

        self.rag = (grain.MapDataset.source(list(range(len(self.questions)))).shuffle(seed=seed).repeat(None)
                    .random_map(rag_row, seed=seed)
                    .batch(tc.rag_batch_size, drop_remainder=True, batch_fn=rag_batch))
        # GRIT negatives: the gold passage's hard negatives (same person, other sections; mentions) and as
        # many passages of the same section about other people. Without the latter, "which section"
        # separates positives from hard negatives and the embeddings collapse to the section type
        # (all Attributes passages alike: InfoNCE stalls at ln(batch)), losing the names.
        sections: dict[str, list[int]] = {}
        for i, p in enumerate(data.train_passages):
            sections.setdefault(p["section"], []).append(i)
        records = []
        shuffle = random.Random(seed)
        for q in self.questions:
            g = q["gold"][0]
            hard = [i for i in negatives[g] if i not in q["gold"]]
            same = [i for i in sections[data.train_passages[g]["section"]] if i not in q["gold"]]
            negs = hard + shuffle.sample(same, min(len(same), max(len(hard), tc.group_size - 1)))
            if len(negs) < tc.group_size - 1:
                negs += shuffle.sample([i for i in range(len(texts)) if i not in q["gold"]], tc.group_size - 1)
            records.append({"query": [tc.grit_instruction, q["question"]], "pos": [texts[i] for i in q["gold"]],
                            "neg": [texts[i] for i in negs]})
        gcfg = GritDataConfig(embedding_batch_size=tc.embedding_batch_size, group_size=tc.group_size,
                              query_max_len=self.query_max_len, passage_max_len=self.passage_max_len, seed=seed)
        self.grit = embedding_dataset(records, tokenizer, gcfg, fmt)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The global batch of 0-based ``step``: GRIT keys (``rag_jax.data.grit``) and Block-Attention keys
        (``rag_jax.data.block_rag.collate``); a function of the step alone (resume-safe)."""
        return {**self.grit[step], **self.rag[step]}
