"""Artificial Needles prompts (``rag_jax.data.needles``) and RULER-style tasks (``rag_jax.data.ruler``): each
answer re-derived from the generated text by an independent parser (the text is the ground truth a model sees),
and the tasks' prompts in ``long_context`` (byte tokenizer, no model)."""
import ast
import re
from collections import Counter

import numpy as np
import pytest

from rag_jax.data import needles, ruler

FILLER = ["The grass is green. ", "The sky is blue. ", "The sun is yellow. ", "Here we go. "]


def _dicts(prompt: str) -> list[dict]:
    return [ast.literal_eval(m) for m in re.findall(r"^Dictionary \[\d+\] (\{.*\})$", prompt, re.M)]


@pytest.mark.parametrize("variant", needles.VARIANTS)
@pytest.mark.parametrize("template", [True, False])
def test_needle_answer_is_the_unique_lookup_in_the_printed_dictionaries(variant, template):
    seed = int(np.random.default_rng().integers(1 << 30))
    for ex in needles.needle_examples(seed, 5, num_dicts=int(np.random.default_rng(seed).integers(2, 40)),
                                      variant=variant, template=template):
        dicts = _dicts(ex.prompt)
        names = [int(n) for n in re.findall(r"^Dictionary \[(\d+)\]", ex.prompt, re.M)]
        assert names == list(range(1, len(dicts) + 1)) and ex.depth == (ex.name - 1) / len(dicts)
        norm = lambda k: k if isinstance(k, tuple) else (k,)  # noqa: E731
        asked = sorted(ex.key)
        hits = [(i + 1, v) for i, d in enumerate(dicts) for k, v in d.items() if sorted(norm(k)) == asked]
        assert hits == [(ex.name, ex.value)]                                   # the key once, in the gold dict
        values = [v for d in dicts for v in d.values()]
        assert values.count(ex.value) == 1                                     # the value once
        for d in dicts:
            assert 3 <= len(d) <= 4
            for k, v in d.items():
                assert all(100 <= x <= 9999 for x in (*norm(k), v))
        width = 3 if variant == "multi_subkey" else 1
        assert all(len(norm(k)) == width for d in dicts for k in d)
        assert ("Answer in the following template" in ex.prompt) == template
        assert ex.answer == f"The value of key {ex.answer.split('key ')[1].split(' is ')[0]} is {ex.value} and it is " \
                            f"in Dictionary [{ex.name}]."
        assert needles.reply_score(ex.answer, ex) == {"value": True, "dictionary": True}
        assert needles.reply_score("no idea", ex) == {"value": False, "dictionary": False}
    if variant == "multi_subkey":     # distractors share all but one subkey with the gold key somewhere
        ex = needles.needle_example(np.random.default_rng(seed), num_dicts=60, variant=variant)
        near = [k for d in _dicts(ex.prompt) for k in d if len(set(k) & set(ex.key)) == 2]
        assert near


def test_needle_bad_arguments_are_one_line_errors():
    rng = np.random.default_rng(0)
    for kwargs, match in [({"variant": "tree"}, "variant='tree'; valid: simple, multi_subkey"),
                          ({"num_dicts": 0}, "num_dicts=0 must be >= 1"),
                          ({"digits": (4, 3)}, "digits=\\(4, 3\\)"),
                          ({"variant": "multi_subkey", "subkeys": 1}, "subkeys=1 must be >= 2"),
                          ({"num_dicts": 3, "gold_index": 3}, "gold_index=3 must be in \\[0, num_dicts=3\\)")]:
        with pytest.raises(ValueError, match=match):
            needles.needle_example(rng, **kwargs)


def _needles_in(text):
    return re.findall(r"One of the special magic numbers for (\w+) is: (\d+)\.", text)


@pytest.mark.parametrize("task,keys,per_key,queries", [("niah_single", 1, 1, 1), ("niah_multikey", 4, 1, 1),
                                                      ("niah_multivalue", 1, 4, 1), ("niah_multiquery", 4, 1, 4)])
def test_niah_answers_are_the_needles_of_the_asked_keys(task, keys, per_key, queries):
    seed = [int(np.random.default_rng().integers(1 << 30)), 0]
    depth = float(np.random.default_rng().random())
    item = ruler.make_item(task, seed, 200, FILLER, depth)
    found = _needles_in(item.context)
    assert len({k for k, _ in found}) == keys and len(found) == keys * per_key
    asked = re.search(r"numbers for (.+) mentioned", item.question).group(1).replace(" and ", ", ").split(", ")
    assert len(asked) == queries and item.prefix.startswith("The special magic number")
    assert sorted(item.answers) == sorted(v for k, v in found if k in asked)
    assert abs(item.context.index(item.evidence[0]) / len(item.context) - depth) < 0.05
    assert ruler.make_item(task, seed, 50, FILLER, depth).answers == item.answers   # only the filler grows
    assert ruler.score(" ".join(item.answers), item.answers) == 1.0
    assert ruler.score(item.answers[0], item.answers) == 1 / len(item.answers)


def test_variable_tracking_answers_resolve_the_chain():
    item = ruler.make_item("vt", [int(np.random.default_rng().integers(1 << 30))], 150, FILLER, 0.2)
    value = re.search(r"assigned the value (\d+)", item.question).group(1)
    env = {}
    for name, rhs in re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", item.context):
        env[name] = env[rhs[4:]] if rhs.startswith("VAR ") else rhs
    assert sorted(item.answers) == sorted(n for n, v in env.items() if v == value) and len(item.answers) == 5


def test_common_and_frequent_words_are_the_recounted_top_words():
    seed = int(np.random.default_rng().integers(1 << 30))
    for size in (50, 400, 1500):
        cwe = ruler.make_item("cwe", [seed], size)
        counts = Counter(re.findall(r"^\d+\. (\w+)$", cwe.context, re.M)).most_common()
        assert sorted(cwe.answers) == sorted(w for w, _ in counts[:10]) and counts[9][1] > counts[10][1]
        fwe = ruler.make_item("fwe", [seed], size)
        counts = Counter(fwe.context.split(". ", 1)[1].split(" .... ")).most_common()
        assert list(fwe.answers) == [w for w, _ in counts[:3]]
        assert counts[0][1] > counts[1][1] > counts[2][1] > counts[3][1]


def test_ruler_errors_and_score():
    with pytest.raises(ValueError, match="task='qa'; valid: niah_single"):
        ruler.make_item("qa", 0, 10, FILLER)
    with pytest.raises(ValueError, match="needs filler"):
        ruler.make_item("vt", 0, 10)
    with pytest.raises(ValueError, match="depth=1.5 must be in"):
        ruler.make_item("niah_single", 0, 10, FILLER, 1.5)
    assert ruler.score("The numbers are 12 and 34.", ("12", "34", "56")) == 2 / 3
    assert ruler.score("BAFOB, zolaz", ("bafob", "ZOLAZ")) == 1.0


@pytest.mark.parametrize("task", ruler.TASKS + ("passkey_once",))
def test_long_context_prompts_of_the_new_tasks(task, tmp_path):
    from test_long_context import _loaded
    from rag_jax.inference.chat import user_prompt
    from rag_jax.recipes.em_llm import tasks

    loaded = _loaded(tmp_path)
    prompts = tasks.make_prompts(loaded, task, 1500, 2, seed=3, filler="repeat")
    assert [p.depth for p in prompts][:1] and len(prompts) == 2
    for p in prompts:
        text = loaded.tokenizer.decode(p.ids.tolist())
        assert abs(len(p.ids) - 1500) < 150 and text.endswith(p.prefix)
        assert user_prompt(loaded, "".join(p.parts), p.prefix).ids == p.ids.tolist()   # parts = the message
        for a in p.answers or (p.answer,):
            assert a in text
        if task == "passkey_once":
            assert text.count(p.answer) == 1 and p.prefix == ""
            assert loaded.tokenizer.decode(p.ids[p.evidence].tolist()) == p.answer
            assert tasks.score(task, f" {p.answer}", p) == 1.0
        else:
            assert tasks.score(task, " ".join(p.answers), p) == 1.0
            assert tasks.score(task, "", p) == 0.0
