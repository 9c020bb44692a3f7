"""The prompts and scoring of ``rag-jax eval long_context`` (``rag_jax.recipes.em_llm.long_context``): each task's
prompts as token ids under the model's chat template, the evidence's token positions, and the reply's score.

Tasks (``TASKS``): ``passkey`` (∞-Bench wording, reply prefix "The pass key is"), ``passkey_once`` (stated once,
no reply prefix), ``kv`` (the shared 75-key file), ``haystack`` (a PhantomWiki article among others) and the
RULER-style tasks of ``rag_jax.data.ruler``, ``nq`` (an NQ-open gold passage among others: RULER's QA on real
data); the long_context module docstring describes each.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from rag_jax.data import ruler
from rag_jax.data.loaders import load_kv_retrieval, load_nq_oracle, nq_passage_pool, shared_file
from rag_jax.metrics import best_subspan_em, normalize_answer
from rag_jax.data.phantom import _ATTRIBUTE_TEXT, generate_universe
from rag_jax.recipes.em_llm.passkey import FILLER, KV_FILE, kv_prompt
from rag_jax.inference.chat import user_prompt

FILLERS = ("repeat", "phantom")
TASKS = ("passkey", "passkey_once", "kv", "haystack", "nq", *ruler.TASKS)
TASK_NAMES = {"passkey": "Passkey", "passkey_once": "Passkey stated once, no reply prefix",
              "kv": "KV retrieval (75 keys)", "haystack": "PhantomWiki haystack (1-hop)",
              "nq": "NQ-open QA (gold passage among others)",
              "niah_single": "RULER NIAH single", "niah_multikey": "RULER NIAH multi-key",
              "niah_multivalue": "RULER NIAH multi-value", "niah_multiquery": "RULER NIAH multi-query",
              "vt": "RULER variable tracking", "cwe": "RULER common words", "fwe": "RULER frequent words"}
MAX_NEW_TOKENS = {"passkey": 8, "passkey_once": 24, "kv": 40, "haystack": 16, "nq": 32, "niah_single": 16,
                  "niah_multikey": 16, "niah_multivalue": 48, "niah_multiquery": 48, "vt": 32, "cwe": 64, "fwe": 24}
ONCE_NEEDLE = "The secret code is {key}. "
ONCE_QUESTION = "\n\nWhat is the secret code? Reply with the number only."
INSTRUCTION = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the pass key.\n\n")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key?"
ANSWER_PREFIX = "The pass key is"


def filler_sentences(kind: str, seed: int = 0) -> list[str]:
    """Sentences the filler is cut from (each ends with a space or newline)."""
    if kind == "repeat":
        return [s + ". " for s in FILLER.strip().rstrip(".").split(". ")]
    if kind == "phantom":
        universe = generate_universe(num_people=300, seed=seed, num_questions=0)
        return [line + "\n" for a in universe.articles for line in a["article"].split("\n")]
    raise ValueError(f"filler={kind!r}; valid: {FILLERS}")


def passkey_prompt(loaded, sentences: list[str], length: int, depth: float, key: str
                   ) -> tuple[np.ndarray, np.ndarray]:
    """A prompt of about ``length`` tokens (whole filler sentences, cycled) with the needle at relative
    ``depth`` in [0, 1], ending with the answer prefix.

    Returns (int32 ``[seq]`` token ids, int64 indices of the tokens of the needle's two copies of ``key``).
    Raises ValueError if ``length`` leaves no room for filler.
    """
    needle = NEEDLE.format(key=key)

    def build(count: int):
        picked = [sentences[i % len(sentences)] for i in range(count)]
        cut = int(round(depth * count))
        return user_prompt(loaded, INSTRUCTION + "".join(picked[:cut]) + needle + "".join(picked[cut:]) + QUESTION,
                       ANSWER_PREFIX)

    count = _fit(build, length, tokens_per_piece=4)
    enc = build(count)
    text = enc.text
    start = text.index(needle, text.index(INSTRUCTION))
    key_chars = [start + m.start() for m in re.finditer(key, needle)]
    return np.asarray(enc.ids, np.int32), _char_tokens(enc, [(c, c + len(key)) for c in key_chars])


def first_number(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One evaluation prompt.

    Attributes:
      ids: int32 ``[seq]`` token ids, ending with the reply prefix ``prefix``.
      answer: the gold string; depth: relative position of the evidence in the context, in [0, 1].
      tag: the prompt's identity within its length (passkey key, KV key, haystack question).
      evidence: int64 token indices holding the answer in the context (diagnostics).
      prefix: the assistant reply prefix already in ``ids``.
      answers: every expected string of a RULER task (``rag_jax.data.ruler.score``; ``answer`` joins them);
        empty for the single-answer tasks.
      parts: the user message as ``(instruction, haystack, question)`` (concatenated it is the message), so a
        retriever can put chosen chunks of the haystack in its place (``rag_jax.recipes.rapid``); empty for
        ``passkey`` and ``kv``.
    """

    ids: np.ndarray
    answer: str
    depth: float
    tag: str
    evidence: np.ndarray
    prefix: str
    answers: tuple[str, ...] = ()
    parts: tuple[str, str, str] | tuple[()] = ()


def _char_tokens(enc, spans) -> np.ndarray:
    """Indices of the tokens of ``enc`` overlapping any character span ``(start, end)``."""
    return np.asarray([i for i, (a, b) in enumerate(enc.offsets) if any(a < e and b > s for s, e in spans)], np.int64)


def passkey_prompts(loaded, length: int, samples: int, seed: int, filler: str) -> list[Prompt]:
    """``samples`` passkey prompts of about ``length`` tokens, keys at depths ``(i + 0.5) / samples``."""
    rng = np.random.default_rng([seed, length])
    sentences = filler_sentences(filler, seed)
    out = []
    for i in range(samples):
        key, depth = str(rng.integers(10000, 100000)), (i + 0.5) / samples
        ids, key_tokens = passkey_prompt(loaded, sentences, length, depth, key)
        out.append(Prompt(ids, key, depth, key, key_tokens, ANSWER_PREFIX))
    return out


def kv_prompts(loaded, samples: int, seed: int) -> list[Prompt]:
    """``samples`` examples of the shared KV-retrieval file (75 UUID pairs, ~5.4K SmolLM2 tokens; Liu et al.'s
    "Lost in the Middle" format), drawn with ``seed``. The reply starts with the gold key's own JSON prefix
    ``"KEY": "`` (as "The pass key is" starts the passkey reply), so the value is what follows it."""
    if not KV_FILE.exists():
        raise FileNotFoundError(f"{KV_FILE} is absent (the shared lost_in_the_middle data; set RAG_JAX_SHARED_DATA)")
    examples = load_kv_retrieval(KV_FILE)
    picks = np.random.default_rng(seed).choice(len(examples), size=min(samples, len(examples)), replace=False)
    out = []
    for ex in (examples[i] for i in picks):
        prefix = f'"{ex.key}": "'
        enc = user_prompt(loaded, kv_prompt(ex.kv_records, ex.key), prefix)
        text = enc.text
        gold = text.index(f'"{ex.key}": "{ex.value}"')
        keys = [k for k, _ in ex.kv_records]
        out.append(Prompt(np.asarray(enc.ids, np.int32), ex.value, keys.index(ex.key) / len(keys), ex.key,
                          _char_tokens(enc, [(gold, gold + len(ex.key) + len(ex.value) + 6)]), prefix))
    return out


HAYSTACK_INSTRUCTION = "Below are articles of a fictional encyclopedia. Answer the question about them.\n\n"
HAYSTACK_ATTRIBUTES = ("job", "hobby", "dob")


def haystack_prompts(loaded, length: int, samples: int, seed: int) -> list[Prompt]:
    """``samples`` needle-in-a-real-haystack questions of about ``length`` tokens: articles of one generated
    PhantomWiki universe (``rag_jax.data.phantom``, ~130 tokens each, enough people to fill ``length``) in a
    seeded order, the article of the person asked about at depth ``(i + 0.5) / samples``, then a 1-hop attribute
    question ("What is the hobby of X?"; occupation, hobby, date of birth in turn); the reply starts "The hobby
    of X is". Correct when the reply contains the value. Names are unique within a universe, and only X's own
    article states X's attributes."""
    universe = generate_universe(num_people=max(100, length // 80), seed=seed, num_questions=0)
    rng = np.random.default_rng([seed, length])
    order = rng.permutation(len(universe.people))
    out = []
    for i, person_index in enumerate(rng.choice(len(universe.people), size=samples, replace=False)):
        person, depth = universe.people[person_index], (i + 0.5) / samples
        by_title = {a["title"]: a["article"] for a in universe.articles}
        needle = by_title[person.name]
        others = [by_title[universe.people[j].name] for j in order if j != person_index]
        attribute = HAYSTACK_ATTRIBUTES[i % len(HAYSTACK_ATTRIBUTES)]
        name = _ATTRIBUTE_TEXT[attribute]
        question = f"\nWhat is the {name} of {person.name}?"
        prefix = f"The {name} of {person.name} is"

        def pieces(count: int):
            picked = [others[j % len(others)] for j in range(count)]
            cut = int(round(depth * count))
            return HAYSTACK_INSTRUCTION, "\n".join(picked[:cut] + [needle] + picked[cut:]), question

        def build(count: int):
            return user_prompt(loaded, "".join(pieces(count)), prefix)

        count = _fit(build, length, tokens_per_piece=130)
        enc = build(count)
        text = enc.text
        fact = f"{prefix} {getattr(person, attribute)}."
        at = text.index(needle, text.index(HAYSTACK_INSTRUCTION)) + needle.index(fact)
        out.append(Prompt(np.asarray(enc.ids, np.int32), getattr(person, attribute), depth, question.strip(),
                          _char_tokens(enc, [(at, at + len(fact))]), prefix, parts=pieces(count)))
    return out


NQ_FILE = shared_file("lost_in_the_middle", "nq-open-oracle.jsonl.gz")
NQ_INSTRUCTION = ("Write a high-quality answer for the given question using only the provided search results "
                  "(some of which might be irrelevant).\n\n")
NQ_DOCUMENT = "Document (Title: {title}) {text}\n\n"
NQ_QUESTION = "Question: {question}\nAnswer briefly."


def nq_prompts(loaded, length: int, samples: int, seed: int) -> list[Prompt]:
    """``samples`` NQ-open questions of about ``length`` tokens (RULER's QA task on real data): the question's gold
    passage (``nq-open-oracle.jsonl.gz``) at depth ``(i + 0.5) / samples`` among other questions' gold passages in
    a seeded order (Lost in the Middle's document format and instruction; passages that contain one of the
    question's answers are left out of the distractors), the question last, no reply prefix. Scored by
    best-subspan EM over the gold answers (``Prompt.answers``). Questions are drawn with ``[seed, length]``.

    Raises FileNotFoundError where the shared data is absent."""
    if not NQ_FILE.exists():
        raise FileNotFoundError(f"{NQ_FILE} is absent (the shared lost_in_the_middle data; set RAG_JAX_SHARED_DATA)")
    examples = load_nq_oracle(NQ_FILE)
    pool, gold_ids = nq_passage_pool(examples)
    docs = [NQ_DOCUMENT.format(title=p.title, text=p.text) for p in pool]
    texts = [normalize_answer(p.text) for p in pool]
    rng = np.random.default_rng([seed, length])
    order = rng.permutation(len(pool))
    out = []
    for i, q in enumerate(rng.choice(len(examples), size=samples, replace=False)):
        ex, depth = examples[q], (i + 0.5) / samples
        golds = [normalize_answer(a) for a in ex.answers]
        others = [docs[j] for j in order if j != gold_ids[q]
                  and not any(g and g in texts[j] for g in golds)]
        needle, question = docs[gold_ids[q]], "\n" + NQ_QUESTION.format(question=ex.question)

        def pieces(count: int, needle=needle, depth=depth, others=others, question=question):
            picked = [others[j % len(others)] for j in range(count)]
            cut = int(round(depth * count))
            return NQ_INSTRUCTION, "".join(picked[:cut] + [needle] + picked[cut:]).rstrip("\n"), question

        def build(count: int, pieces=pieces):
            return user_prompt(loaded, "".join(pieces(count)), "")

        count = _fit(build, length, tokens_per_piece=150)
        enc = build(count)
        at = enc.text.index(needle, enc.text.index(NQ_INSTRUCTION))
        out.append(Prompt(np.asarray(enc.ids, np.int32), ex.answers[0], depth, ex.question,
                          _char_tokens(enc, [(at, at + len(needle))]), "", tuple(ex.answers), pieces(count)))
    return out


def passkey_once_prompts(loaded, length: int, samples: int, seed: int, filler: str) -> list[Prompt]:
    """``samples`` passkey prompts in which the key is stated once ("The secret code is NNNNN.") and the reply has
    no prefix: the instruction-free needle of issue 30 (with ``filler="phantom"``, a fact stated once in prose).
    Keys at depths ``(i + 0.5) / samples``; correct when the reply's first number is the key."""
    rng = np.random.default_rng([seed, length, 1])
    sentences = filler_sentences(filler, seed)
    out = []
    for i in range(samples):
        key, depth = str(rng.integers(10000, 100000)), (i + 0.5) / samples
        needle = ONCE_NEEDLE.format(key=key)

        def pieces(count: int, needle=needle, depth=depth):
            picked = [sentences[j % len(sentences)] for j in range(count)]
            cut = int(round(depth * count))
            return "", "".join(picked[:cut]) + needle + "".join(picked[cut:]), ONCE_QUESTION

        def build(count: int, pieces=pieces):
            return user_prompt(loaded, "".join(pieces(count)), "")

        count = _fit(build, length, tokens_per_piece=4)
        enc = build(count)
        at = enc.text.index(needle) + needle.index(key)
        out.append(Prompt(np.asarray(enc.ids, np.int32), key, depth, key, _char_tokens(enc, [(at, at + len(key))]), "",
                          parts=pieces(count)))
    return out


def ruler_prompts(loaded, task: str, length: int, samples: int, seed: int, filler: str) -> list[Prompt]:
    """``samples`` RULER-style prompts of ``task`` (``rag_jax.data.ruler``) of about ``length`` tokens, the asked
    needle at depth ``(i + 0.5) / samples`` (haystack tasks); prompt ``i`` is drawn from seed ``[seed, i]`` and
    only its amount of filler depends on ``length``."""
    sentences = filler_sentences(filler, seed)
    per_unit = {"cwe": 4, "fwe": 4}.get(task, 8)
    out = []
    for i in range(samples):
        depth = (i + 0.5) / samples

        def build(count: int, i=i, depth=depth):
            item = ruler.make_item(task, [seed, i], max(count, 1), sentences, depth)
            return user_prompt(loaded, item.context + item.question, item.prefix), item

        enc, item = build(_fit(lambda c: build(c)[0], length, tokens_per_piece=per_unit))
        spans = [(enc.text.index(e), enc.text.index(e) + len(e)) for e in item.evidence if e in enc.text]
        out.append(Prompt(np.asarray(enc.ids, np.int32), ", ".join(item.answers), item.depth, f"{task}:{i}",
                          _char_tokens(enc, spans), item.prefix, item.answers, ("", item.context, item.question)))
    return out


def _fit(build, length: int, tokens_per_piece: int) -> int:
    """The count of filler pieces for which ``build(count)`` (an ``Encoded`` prompt) is about ``length`` tokens:
    a first guess from ``tokens_per_piece``, then three rescales (pieces alone tokenize differently from the
    running text).

    Raises ValueError if ``length`` leaves no room for filler."""
    overhead = len(build(0).ids)
    if length <= overhead:
        raise ValueError(f"length={length} tokens leaves no room for filler (the prompt alone is {overhead})")
    count = max(1, (length - overhead) // tokens_per_piece)
    for _ in range(3):
        filler_tokens = len(build(count).ids) - overhead
        count = max(1, int(count * (length - overhead) / max(filler_tokens, 1)))
    return count


def score(task: str, reply: str, prompt: Prompt) -> float:
    """The prompt's score in [0, 1]: best-subspan EM for ``nq`` (any gold answer), RULER's fraction of expected
    strings found for its tasks, else ``correct``."""
    if task == "nq":
        return best_subspan_em(reply, prompt.answers)
    if prompt.answers:
        return ruler.score(reply, prompt.answers)
    return float(correct(task, reply, prompt.answer))


def correct(task: str, reply: str, answer: str) -> bool:
    """Passkey: the first number of the reply is the key; KV and haystack: the reply contains the answer
    (case-insensitive for the haystack's words)."""
    if task in ("passkey", "passkey_once"):
        return first_number(reply) == answer
    if task == "kv":
        return answer in reply
    return answer.lower() in reply.lower()


def make_prompts(loaded, task: str, length: int, samples: int, seed: int, filler: str = "repeat") -> list[Prompt]:
    """The prompts of one task and length (``kv``: the file's examples, whatever ``length``)."""
    if task == "passkey":
        return passkey_prompts(loaded, length, samples, seed, filler)
    if task == "passkey_once":
        return passkey_once_prompts(loaded, length, samples, seed, filler)
    if task in ruler.TASKS:
        return ruler_prompts(loaded, task, length, samples, seed, filler)
    if task == "kv":
        return kv_prompts(loaded, samples, seed)
    if task == "haystack":
        return haystack_prompts(loaded, length, samples, seed)
    if task == "nq":
        return nq_prompts(loaded, length, samples, seed)
    raise ValueError(f"task={task!r}; valid: {TASKS}")
