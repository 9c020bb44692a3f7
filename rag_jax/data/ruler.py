"""RULER-style synthetic long-context tasks (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?", §3 and its ``synthetic.yaml`` templates), generated offline and seeded.

Each task builds an ``Item``: a context of ``size`` units (filler sentences, or list words), the question, the
assistant's reply prefix and the expected strings. Its length in tokens is set by the caller, who searches the
``size`` whose prompt has the wanted number of tokens (``rag_jax.recipes.em_llm.long_context``). In the haystack
tasks (``niah_*``, ``vt``) everything but the amount of filler (needles, keys, values, variable names) depends only
on the seed, so the items of one seed at two lengths ask the same thing. The metric is RULER's ``string_match_all``: the fraction of
the expected strings found in the reply (case-insensitive; ``score``).

Tasks (``TASKS``):

- ``niah_single``: one needle "One of the special magic numbers for KEY is: 1234567." in the filler.
- ``niah_multikey``: the same with three distractor needles for other keys.
- ``niah_multivalue``: four needles for the same key; all four values expected.
- ``niah_multiquery``: four needles for four keys; the question asks for all four values.
- ``vt`` (variable tracking): a chain "VAR A = 12345", "VAR B = VAR A", ... (4 hops) spread through the filler;
  every variable of the chain expected.
- ``cwe`` (common words extraction): a numbered list of ``size`` words in which 10 words appear ``size // 30``
  times (4 to 30; RULER: 30) and the others 3 times; the 10 common words expected.
- ``fwe`` (frequent words extraction): coded words drawn from a Zipf law (alpha 2) separated by " .... "; the 3
  most frequent expected, each strictly more frequent than the next (``size`` = number of words).

Keys and words are pronounceable made-up words (consonant-vowel syllables, no English list needed offline).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

import numpy as np

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
NEEDLE = "One of the special magic numbers for {key} is: {value}. "
NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
              "I will quiz you about the numbers afterwards.\n")
_CONSONANTS = "bcdfghjklmnprstvz"
_VOWELS = "aeiou"


@dataclasses.dataclass(frozen=True)
class Item:
    """One RULER-style prompt before tokenization.

    Attributes:
      context: the haystack with its needles (untrusted text: goes in the user message as content).
      question: the question after the context.
      prefix: the assistant's reply prefix (RULER's answer prefix).
      answers: the expected strings (all of them count).
      evidence: substrings of ``context`` that carry the answers (needles, assignments), for diagnostics.
      depth: relative position of the first evidence in the context, in [0, 1].
    """

    context: str
    question: str
    prefix: str
    answers: tuple[str, ...]
    evidence: tuple[str, ...]
    depth: float


def score(reply: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_all``: the fraction of ``answers`` found in ``reply`` (case-insensitive)."""
    if not answers:
        raise ValueError("answers is empty; a task expects at least one string")
    low = reply.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


def made_up_words(rng: np.random.Generator, count: int, syllables: tuple[int, int] = (2, 3)) -> list[str]:
    """``count`` distinct pronounceable words of ``syllables`` consonant-vowel syllables."""
    out: dict[str, None] = {}
    while len(out) < count:
        n = int(rng.integers(syllables[0], syllables[1] + 1))
        out["".join(_CONSONANTS[rng.integers(len(_CONSONANTS))] + _VOWELS[rng.integers(len(_VOWELS))]
                    for _ in range(n))] = None
    return list(out)


def _insert(filler: Sequence[str], size: int, pieces: Sequence[str], depths: Sequence[float]) -> tuple[str, float]:
    """``size`` filler sentences (cycled) with ``pieces`` inserted at relative ``depths``; the text and the first
    piece's relative character position."""
    sentences = [filler[i % len(filler)] for i in range(size)]
    cuts = sorted(zip((int(round(d * size)) for d in depths), range(len(pieces))), reverse=True)
    for cut, j in cuts:
        sentences.insert(cut, pieces[j])
    text = "".join(sentences)
    return text, text.index(pieces[0]) / max(len(text), 1)


def _niah(rng, size, filler, depth, *, keys: int, values_per_key: int, queries: int) -> Item:
    names = made_up_words(rng, keys)
    values = [[str(int(rng.integers(1_000_000, 10_000_000))) for _ in range(values_per_key)] for _ in names]
    first = [NEEDLE.format(key=names[0], value=v) for v in values[0]]          # the asked key's, first
    others = [NEEDLE.format(key=k, value=v) for k, vs in zip(names[1:], values[1:]) for v in vs]
    needles = first + [others[i] for i in rng.permutation(len(others))]
    depths = [(depth + j / len(needles)) % 1.0 for j in range(len(needles))]   # the first at ``depth``, others spread
    context, first = _insert(filler, size, needles, depths)
    asked = names[:queries]
    answers = tuple(v for k in asked for v in values[names.index(k)])
    what = "numbers" if len(answers) > 1 else "number"
    keys_text = ", ".join(asked[:-1]) + (" and " if len(asked) > 1 else "") + asked[-1]
    question = f"\nWhat are all the special magic numbers for {keys_text} mentioned in the provided text?"
    prefix = f"The special magic {what} for {keys_text} mentioned in the provided text {'are' if len(answers) > 1 else 'is'}"
    return Item(NIAH_INTRO + context, question, prefix, answers,
                tuple(n for n in needles if any(f"for {k} is" in n for k in asked)), first)


def _vt(rng, size, filler, depth, hops: int = 4) -> Item:
    names = [w.upper()[:5] for w in made_up_words(rng, hops + 1, (3, 3))]
    value = str(int(rng.integers(10_000, 100_000)))
    chain = [f"VAR {names[0]} = {value}. "] + [f"VAR {names[i]} = VAR {names[i - 1]}. " for i in range(1, hops + 1)]
    depths = np.linspace(depth, min(1.0, depth + 0.5), len(chain)).tolist()
    context, first = _insert(filler, size, chain, depths)
    question = f"\nQuestion: Find all variables that are assigned the value {value} in the text above."
    prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, {len(names)} variables "
              f"are assigned the value {value}, they are:")
    return Item("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n" + context,
                question, prefix, tuple(names), tuple(chain), first)


def _cwe(rng, size, common: int = 10, rare_freq: int = 3) -> Item:
    # RULER keeps 10 common words x 30 and rare words x 3 at 4K+ tokens; with ``size`` list entries here the
    # common frequency is size // 30 clipped to [4, 30], so short prompts keep the task (common words 4x+ as frequent).
    freq = int(np.clip(size // 30, 4, 30))
    rare = max(0, (size - common * freq) // rare_freq)
    words = made_up_words(rng, common + rare)
    bag = [w for w in words[:common] for _ in range(freq)] + [w for w in words[common:] for _ in range(rare_freq)]
    bag = [bag[i] for i in rng.permutation(len(bag))]
    context = "".join(f"{i + 1}. {w}\n" for i, w in enumerate(bag))
    return Item("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n" + context,
                f"\nQuestion: What are the {common} most common words in the above list?",
                f"Answer: The top {common} words that appear most often in the list are:", tuple(words[:common]),
                (), 0.0)


def _fwe(rng, size, top: int = 3, alpha: float = 2.0, vocab: int = 200) -> Item:
    words = made_up_words(rng, vocab, (2, 2))
    for _ in range(1000):            # redraw until the top ``top`` counts are strictly ordered (an exact answer)
        draws = np.minimum(rng.zipf(alpha, max(size, 8 * top)), vocab) - 1
        counts = Counter(draws.tolist()).most_common()
        if len(counts) > top and all(counts[i][1] > counts[i + 1][1] for i in range(top)):
            break
    else:
        raise ValueError(f"fwe: no draw of {max(size, 8 * top)} words has a strictly ordered top {top}")
    context = " .... ".join(words[i] for i in draws)
    return Item("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. " + context,
                "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text?",
                "Answer: According to the coded text above, the three most frequently appeared words are:",
                tuple(words[i] for i, _ in counts[:top]), (), 0.0)


def make_item(task: str, seed, size: int, filler: Sequence[str] = (), depth: float = 0.5) -> Item:
    """The ``task`` prompt drawn from ``np.random.default_rng(seed)`` with ``size`` context units.

    Args:
      task: one of ``TASKS``.
      seed: an int or a sequence of ints (``np.random.default_rng`` accepts both).
      size: filler sentences (``niah_*``, ``vt``) or list entries (``cwe``, ``fwe``); >= 1.
      filler: the sentences the haystack is cut from (each ending in a space or newline); needed by ``niah_*``
        and ``vt``.
      depth: where the (first) asked needle sits, in [0, 1].

    Raises:
      ValueError: an unknown task, ``size < 1``, ``depth`` outside [0, 1] or no filler for a haystack task.
    """
    if task not in TASKS:
        raise ValueError(f"task={task!r}; valid: {', '.join(TASKS)}")
    if size < 1:
        raise ValueError(f"size={size} must be >= 1")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1]")
    if (task.startswith("niah") or task == "vt") and not filler:
        raise ValueError(f"task {task} needs filler sentences")
    rng = np.random.default_rng(seed)
    if task == "niah_single":
        return _niah(rng, size, filler, depth, keys=1, values_per_key=1, queries=1)
    if task == "niah_multikey":
        return _niah(rng, size, filler, depth, keys=4, values_per_key=1, queries=1)
    if task == "niah_multivalue":
        return _niah(rng, size, filler, depth, keys=1, values_per_key=4, queries=1)
    if task == "niah_multiquery":
        return _niah(rng, size, filler, depth, keys=4, values_per_key=1, queries=4)
    if task == "vt":
        return _vt(rng, size, filler, depth)
    if task == "cwe":
        return _cwe(rng, size)
    return _fwe(rng, size)
