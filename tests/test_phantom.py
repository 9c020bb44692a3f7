"""PhantomWiki-style generator: answers against an independent brute force over the article facts.

The brute force below parses the *rendered* question text and the fact strings with its own regexes
and evaluates relations as Prolog-style joins of pair sets (rules_derived.pl style); it shares no
code with rag_jax.data.phantom.
"""
import calendar
import collections
import json
import os
import re
import subprocess
import sys
import time

import pytest

from rag_jax.data.phantom import FactBase, evaluate_query, generate_universe, parse_fact

FACT = re.compile(r'^(\w+)\("([^"]*)", "([^"]*)"\)\.$')
ATTR = {"date of birth": "dob", "occupation": "job", "hobby": "hobby", "gender": "gender"}
PLURAL = {"parents": "parent", "children": "child", "siblings": "sibling", "friends": "friend",
          "sons": "son", "daughters": "daughter", "brothers": "brother", "sisters": "sister",
          "mothers": "mother", "fathers": "father", "wives": "wife", "husbands": "husband"}


def join(r, s):
    by_first = collections.defaultdict(set)
    for y, z in s:
        by_first[y].add(z)
    return {(x, z) for x, y in r for z in by_first[y]}


def relations(articles, only=None):
    """All relation pair sets from the facts of the given articles (all when only is None)."""
    p = collections.defaultdict(set)
    for a in articles:
        if only is None or a["title"] in only:
            for f in a["facts"]:
                m = FACT.match(f)
                assert m, f
                p[m[1]].add((m[2], m[3]))
    p["parent"] = p["mother"] | p["father"]
    p["child"] = p["son"] | p["daughter"]
    p["sibling"] = p["brother"] | p["sister"]
    p["spouse"] = p["wife"] | p["husband"]
    p["grandparent"] = join(p["parent"], p["parent"])
    p["grandmother"] = join(p["parent"], p["mother"])
    p["grandfather"] = join(p["parent"], p["father"])
    p["grandchild"] = join(p["child"], p["child"])
    p["granddaughter"] = join(p["child"], p["daughter"])
    p["grandson"] = join(p["child"], p["son"])
    p["aunt"] = join(p["parent"], p["sister"])
    p["uncle"] = join(p["parent"], p["brother"])
    p["niece"] = join(p["sibling"], p["daughter"])
    p["nephew"] = join(p["sibling"], p["son"])
    p["cousin"] = join(join(p["parent"], p["sibling"]), p["child"])
    p["mother-in-law"] = join(p["spouse"], p["mother"])
    p["father-in-law"] = join(p["spouse"], p["father"])
    return p


def persons(phrase, rel):
    m = re.fullmatch(r"the person whose (date of birth|occupation|hobby) is (.+)", phrase)
    if m:
        return {x for x, v in rel[ATTR[m[1]]] if v == m[2]}
    m = re.fullmatch(r"the ([a-z-]+) of (.+)", phrase)
    if m:
        inner = persons(m[2], rel)
        return {y for x, y in rel[m[1]] if x in inner}
    return {phrase}


def brute_force_answer(question, rel):
    m = re.fullmatch(r"What is the (date of birth|occupation|hobby|gender) of (.+)\?", question)
    if m:
        subj = persons(m[2], rel)
        return {v for x, v in rel[ATTR[m[1]]] if x in subj}
    m = re.fullmatch(r"How many ([a-z-]+) does (.+) have\?", question)
    if m:
        r = rel[PLURAL[m[1]]]
        return {str(sum(1 for x, _ in r if x == s)) for s in persons(m[2], rel)}
    m = re.fullmatch(r"Who is (.+)\?", question)
    assert m, question
    return persons(m[1], rel)


@pytest.fixture(scope="module")
def universe():
    return generate_universe(num_people=150, seed=7, max_hops=4, num_questions=400)


def test_answers_match_brute_force(universe):
    rel = relations(universe.articles)
    kinds = collections.Counter()
    for q in universe.questions:
        assert set(q["answer"]) == brute_force_answer(q["question"], rel), q
        kinds[q["question"].split()[0]] += 1
    assert set(kinds) == {"Who", "What", "How"} and min(kinds.values()) > 50, kinds


def test_gold_titles_suffice(universe):
    """The facts of the gold-title articles alone give the same answer set."""
    titles = {a["title"] for a in universe.articles}
    for q in universe.questions:
        assert q["titles"] and set(q["titles"]) <= titles and len(set(q["titles"])) == len(q["titles"])
        rel = relations(universe.articles, only=set(q["titles"]))
        assert set(q["answer"]) == brute_force_answer(q["question"], rel), q
    one_hop_named = [q for q in universe.questions if q["hops"] == 1 and "person whose" not in q["question"]]
    assert one_hop_named
    for q in one_hop_named:  # the answer lives in the named person's article
        assert len(q["titles"]) == 1 and q["titles"][0] in q["question"]


def test_articles_state_their_facts(universe):
    word = {"date of birth": "dob", "occupation": "job", "wives": "wife"}
    for a in universe.articles:
        sentence = re.compile(rf"^The (.+) of {re.escape(a['title'])} (?:is|are) (.+)\.$")
        lines = a["article"].splitlines()
        assert lines[0] == f"# {a['title']}"
        assert [ln for ln in lines if ln.startswith("## ")] == ["## Family", "## Friends", "## Attributes"]
        stated = set()
        for ln in lines:
            m = sentence.match(ln)
            if m:
                rel = word.get(m[1], m[1].removesuffix("s"))
                values = [m[2]] if rel in ("dob", "job", "hobby", "gender") else m[2].split(", ")
                stated |= {(rel, a["title"], v) for v in values}
        assert stated == {parse_fact(f) for f in a["facts"]}, a["title"]


def test_universe_is_consistent(universe):
    people = {p.name: p for p in universe.people}
    assert len(people) == len(universe.people) == len(universe.articles) == 150
    for p in universe.people:
        y, m, d = map(int, p.dob.split("-"))
        assert 1 <= m <= 12 and 1 <= d <= calendar.monthrange(y, m)[1]
        if p.parents:
            mom, dad = (people[x] for x in p.parents)
            assert (mom.gender, dad.gender) == ("female", "male") and mom.spouse == dad.name
            assert p.name in mom.children and p.name in dad.children
            assert all(int(x.dob[:4]) + 20 <= y for x in (mom, dad))
            assert p.name.split()[-1] == dad.name.split()[-1] or p.spouse  # children carry the father's surname
        if p.spouse:
            s = people[p.spouse]
            assert s.spouse == p.name and s.gender != p.gender
        assert p.name not in p.friends and all(p.name in people[f].friends for f in p.friends)
        for value in (p.name, p.job, p.hobby, p.dob):
            assert "," not in value and " of " not in value and '"' not in value
    degree = sum(len(p.friends) for p in universe.people) / len(universe.people)
    assert 2.5 < degree <= 3.0


def test_shape_hops_and_uniqueness(universe):
    keys = {"id", "question", "answer", "hops", "titles", "prolog"}
    for q in universe.questions:
        assert set(q) == keys
        assert q["hops"] == len(q["prolog"]["query"]) and 1 <= q["hops"] <= 4
        assert q["answer"] and all(isinstance(x, str) for x in q["answer"])
    for a in universe.articles:
        assert set(a) == {"title", "article", "facts"}
    assert len({q["id"] for q in universe.questions}) == len({q["question"] for q in universe.questions}) == 400
    hops = collections.Counter(q["hops"] for q in universe.questions)
    assert set(hops) == {1, 2, 3, 4} and min(hops.values()) >= 70, hops  # drawn uniformly
    assert [a["title"] for a in universe.articles] == sorted(a["title"] for a in universe.articles)


def test_evaluate_query_hand_computed():
    facts = [
        'mother("Kid A", "Mum")', 'father("Kid A", "Dad")', 'sister("Kid A", "Kid B")',
        'mother("Kid B", "Mum")', 'father("Kid B", "Dad")', 'brother("Kid B", "Kid A")',
        'mother("Dad", "Granny")', 'son("Granny", "Dad")', 'friend("Kid A", "Kid B")', 'friend("Kid B", "Kid A")',
        'hobby("Kid A", "chess")', 'hobby("Kid B", "chess")', 'hobby("Mum", "go")',
    ]
    fb = FactBase(parse_fact(f + ".") for f in facts)
    assert evaluate_query(fb, ['mother(Y_1, Y_2)', 'parent("Kid A", Y_1)'], "Y_2") == (["Granny"], ["Kid A", "Mum", "Dad"])
    assert evaluate_query(fb, ['sibling(Y_1, Y_2)', 'hobby(Y_1, "chess")'], "Y_2") == (["Kid A", "Kid B"], ["Kid A", "Kid B"])
    assert evaluate_query(fb, ['aggregate_all(count, distinct(child(Y_1, Y_3)), Count_1)', 'parent("Kid B", Y_1)'],
                          "Count_1") == (["0"], ["Kid B", "Mum", "Dad"])
    assert evaluate_query(fb, ['hobby(Y_1, Y_2)', 'friend("Kid A", Y_1)'], "Y_2") == (["chess"], ["Kid A", "Kid B"])
    with pytest.raises(ValueError, match="unknown predicate 'cousin_twice'"):
        evaluate_query(fb, ['cousin_twice("Kid A", Y_1)'], "Y_1")
    with pytest.raises(ValueError, match="unbound"):
        evaluate_query(fb, ['friend(Y_1, Y_2)'], "Y_2")
    with pytest.raises(ValueError, match="not of the form"):
        evaluate_query(fb, ['friend(kid, Y_2)'], "Y_2")


def test_official_answers_reproduced(shared_data):
    """Our query semantics give exactly the official Prolog answers on both shared universes (600 questions)."""
    for name in ("depth6_seed11", "depth10_seed1"):
        folder = shared_data / "phantomwiki" / name
        articles = json.loads((folder / "articles.json").read_text())
        questions = json.loads((folder / "questions.json").read_text())
        fb = FactBase.from_articles(articles)
        rel = relations(articles)
        for q in questions:
            answer, titles = evaluate_query(fb, q["prolog"]["query"], q["prolog"]["answer"])
            assert set(answer) == set(q["answer"]), q["question"]
            assert set(answer) == brute_force_answer(q["question"], rel), q["question"]
            assert set(answer) == brute_force_answer(q["question"], relations(articles, only=set(titles)))


def test_seeded_and_hash_independent():
    a = generate_universe(40, seed=3, num_questions=60)
    assert a == generate_universe(40, seed=3, num_questions=60)
    assert a.articles != generate_universe(40, seed=4, num_questions=60).articles
    code = ("import json,sys; from rag_jax.data.phantom import generate_universe as g; "
            "u=g(40, seed=3, num_questions=60); sys.stdout.write(json.dumps([u.articles, u.questions]))")
    outs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
        outs.append(r.stdout)
    assert outs[0] == outs[1] == json.dumps([a.articles, a.questions])


def test_speed_1000_people_1000_questions():
    t = time.perf_counter()
    u = generate_universe(num_people=1000, seed=0, max_hops=3, num_questions=1000)
    elapsed = time.perf_counter() - t
    print(f"generate_universe(1000 people, 1000 questions): {elapsed:.2f} s")
    assert len(u.articles) == 1000 and len(u.questions) == 1000
    assert elapsed < 20.0  # ~0.4 s on a quiet core; generous for a shared 2-core machine


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_people=1 must be >= 2"):
        generate_universe(num_people=1)
    with pytest.raises(TypeError, match="max_hops must be an int"):
        generate_universe(max_hops=2.0)
    with pytest.raises(ValueError, match="num_questions=-1"):
        generate_universe(num_questions=-1)
    with pytest.raises(ValueError, match="friend_degree"):
        generate_universe(friend_degree=-1)
    with pytest.raises(ValueError, match="found only .* distinct questions"):
        generate_universe(num_people=2, max_hops=1, num_questions=500)
