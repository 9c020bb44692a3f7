"""Synthetic numeric key-value retrieval prompts: the training data of "From Artificial Needles to Real Haystacks"
(Xiong et al., ICLR 2025; generator ``edixiong/artificial-needles``, ``scripts/dict_builder.py`` and
``prompts/dictionary/form2_*``).

A prompt lists ``num_dicts`` dictionaries ``Dictionary [i] {k: v, ...}`` whose keys and values are integers of 3-4
digits (§2: 85 dictionaries of 3-4 keys); one gold dictionary holds the gold key. The question asks for the value
of the gold key and the dictionary it is in; the answer is always the paper's template sentence ("The value of key
K is V and it is in Dictionary [i]."), and ``template=True`` also states that template in the prompt (the paper's
``_wtemplate`` prompts; ``False`` is its ablation, so format learning can be told from retrieval).

Two variants:

- ``simple``: every key is one integer (the paper's "simple dictionary key-value retrieval").
- ``multi_subkey``: every key is a tuple of ``subkeys`` integers, the question lists the gold key's subkeys in a
  shuffled order, and distractor keys share all but one of its subkeys (the paper's multi-subkey retrieval with
  common subkeys: a key cannot be found by matching one number).

Every prompt is checked so that the answer is determined: the gold key occurs once, and the gold value occurs once
(as in ``generate_not_gold_kv_pair``, which redraws a distractor equal to either).
"""
from __future__ import annotations

import dataclasses

import numpy as np

VARIANTS = ("simple", "multi_subkey")
INTRO = "Do a task using the list of dictionaries below.\n\n"
QUESTION = ("\n\nAbove is a list of dictionaries such that each key and value is an integer. "
            "Report the value of key {key} and the dictionary it is in.")
TEMPLATE = " Answer in the following template:\nThe value of key {key} is <fill-in-value> and it is in Dictionary " \
           "[<fill-in-dictionary-name>]."
ANSWER = "The value of key {key} is {value} and it is in Dictionary [{name}]."


@dataclasses.dataclass(frozen=True)
class NeedleExample:
    """One synthetic retrieval prompt.

    Attributes:
      prompt: the user message (dictionaries, question, optional template).
      answer: the reply in the paper's template sentence.
      value: the gold value (the string a reply must contain).
      name: the gold dictionary's name (1-based position in the list).
      key: the gold key's subkeys as asked in the question (shuffled for ``multi_subkey``).
      depth: ``(name - 1) / num_dicts``, the gold dictionary's relative position in [0, 1).
    """

    prompt: str
    answer: str
    value: int
    name: int
    key: tuple[int, ...]
    depth: float


def _number(rng: np.random.Generator, digits: tuple[int, int]) -> int:
    d = int(rng.integers(digits[0], digits[1] + 1))
    return int(rng.integers(10 ** (d - 1), 10 ** d))


def _key_text(key: tuple[int, ...]) -> str:
    return str(key[0]) if len(key) == 1 else "(" + ", ".join(map(str, key)) + ")"


def _dict_text(name: int, d: dict) -> str:
    return f"Dictionary [{name}] {{" + ", ".join(f"{_key_text(k)}: {v}" for k, v in d.items()) + "}"


def needle_example(rng: np.random.Generator, *, num_dicts: int = 85, dict_size: tuple[int, int] = (3, 4),
                   digits: tuple[int, int] = (3, 4), variant: str = "simple", subkeys: int = 3,
                   template: bool = True, gold_index: int | None = None) -> NeedleExample:
    """A seeded prompt (module docstring).

    Args:
      rng: the generator (one prompt per call; the same state gives the same prompt).
      num_dicts: dictionaries in the prompt (>= 1); SmolLM2 tokenizes about 28 tokens per dictionary.
      dict_size: (min, max) keys per dictionary.
      digits: (min, max) digits of every key, subkey and value (the paper: 3-4).
      variant: ``simple`` or ``multi_subkey``.
      subkeys: subkeys per key for ``multi_subkey`` (>= 2).
      template: state the answer template in the prompt.
      gold_index: the gold dictionary's 0-based position; None = uniform.

    Raises:
      ValueError: an unknown variant, ``num_dicts < 1``, a bad range, ``subkeys < 2`` for ``multi_subkey`` or
        ``gold_index`` outside ``[0, num_dicts)``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}; valid: {', '.join(VARIANTS)}")
    if num_dicts < 1:
        raise ValueError(f"num_dicts={num_dicts} must be >= 1")
    for label, (lo, hi) in (("dict_size", dict_size), ("digits", digits)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{label}={(lo, hi)} must be (min, max) with 1 <= min <= max")
    if variant == "multi_subkey" and subkeys < 2:
        raise ValueError(f"subkeys={subkeys} must be >= 2 for the multi_subkey variant")
    gold_index = int(rng.integers(num_dicts)) if gold_index is None else gold_index
    if not 0 <= gold_index < num_dicts:
        raise ValueError(f"gold_index={gold_index} must be in [0, num_dicts={num_dicts})")
    width = subkeys if variant == "multi_subkey" else 1
    gold_key = tuple(_number(rng, digits) for _ in range(width))
    gold_value = _number(rng, digits)

    def distractor_key() -> tuple[int, ...]:
        if width > 1 and rng.random() < 0.5:      # shares all but one subkey with the gold key
            key = list(gold_key)
            key[int(rng.integers(width))] = _number(rng, digits)
            return tuple(key)
        return tuple(_number(rng, digits) for _ in range(width))

    dicts, seen_keys, gold_slot = [], {gold_key}, None
    for i in range(num_dicts):
        size = int(rng.integers(dict_size[0], dict_size[1] + 1))
        if i == gold_index:
            gold_slot = int(rng.integers(size))
        d = {}
        for j in range(size):
            if i == gold_index and j == gold_slot:
                d[gold_key] = gold_value
                continue
            key, value = distractor_key(), _number(rng, digits)
            while key in seen_keys or value == gold_value:
                key, value = distractor_key(), _number(rng, digits)
            seen_keys.add(key)
            d[key] = value
        dicts.append(d)
    asked = tuple(gold_key[i] for i in rng.permutation(width)) if width > 1 else gold_key
    key_text = ", ".join(map(str, asked)) if width > 1 else str(asked[0])
    if width > 1:
        key_text = f"with the subkeys {key_text}"
    prompt = (INTRO + "\n".join(_dict_text(i + 1, d) for i, d in enumerate(dicts))
              + QUESTION.format(key=key_text) + (TEMPLATE.format(key=key_text) if template else ""))
    return NeedleExample(prompt, ANSWER.format(key=key_text, value=gold_value, name=gold_index + 1), gold_value,
                         gold_index + 1, asked, gold_index / num_dicts)


def needle_examples(seed: int, count: int, **kwargs) -> list[NeedleExample]:
    """``count`` prompts of ``needle_example(**kwargs)``, prompt ``i`` drawn from ``np.random.default_rng([seed,
    i])`` (so a prefix of a larger set is the smaller set)."""
    return [needle_example(np.random.default_rng([seed, i]), **kwargs) for i in range(count)]


def reply_score(reply: str, example: NeedleExample) -> dict[str, bool]:
    """``{"value": gold value in the reply, "dictionary": "Dictionary [name]" (or "[name]") in the reply}``."""
    return {"value": str(example.value) in reply,
            "dictionary": f"[{example.name}]" in reply or f"Dictionary {example.name}" in reply}
