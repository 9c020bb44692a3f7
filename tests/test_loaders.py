"""Loaders: real shared files (skipped when ../shared/data is absent), round trips, and clear errors."""
import gzip
import json

import numpy as np
import pytest

from rag_jax.data import loaders
from rag_jax.data.loaders import load_kv_retrieval, load_nq_oracle, load_phantomwiki, nq_passage_pool
from rag_jax.data.phantom import generate_universe


def test_phantomwiki_official_folders(shared_data):
    for name, n_q, max_hops in (("depth6_seed11", 400, 2), ("depth10_seed1", 200, 4)):
        data = load_phantomwiki(shared_data / "phantomwiki" / name)
        raw = json.loads((shared_data / "phantomwiki" / name / "questions.json").read_text())
        assert len(data.articles) == 100 and len(data.questions) == n_q
        titles = {a.title for a in data.articles}
        for q, r in zip(data.questions, raw):
            assert (q.id, q.question, list(q.answer), q.hops) == (r["id"], r["question"], r["answer"], r["difficulty"])
            assert q.titles and set(q.titles) <= titles  # derived from the Prolog query for every question
            assert 1 <= q.hops <= max_hops
    # Hand-checked against the articles: Carmon Kindred's date of birth is 0227-09-18 and her
    # article lists her friends.
    q = load_phantomwiki(shared_data / "phantomwiki" / "depth6_seed11").questions[0]
    assert q.question == "Who is the friend of the person whose date of birth is 0227-09-18?"
    assert q.titles == ("Carmon Kindred",)
    assert q.answer == ("Fidel Durfee", "Ivette Kindred", "Ricardo Everett")


def test_nq_oracle(shared_data):
    path = shared_data / "lost_in_the_middle" / "nq-open-oracle.jsonl.gz"
    examples = load_nq_oracle(path)
    assert len(examples) == 2655
    ex = examples[0]
    assert ex.question == "who got the first nobel prize in physics"
    assert ex.answers == ("Wilhelm Conrad Röntgen",)
    assert ex.gold.title == "List of Nobel laureates in Physics" and ex.gold.is_gold and ex.gold.has_answer
    assert "Röntgen" in ex.gold.text
    passages, gold_ids = nq_passage_pool(examples)
    assert len(passages) == len({(e.gold.title, e.gold.text) for e in examples}) < 2655
    assert all(passages[g].text == e.gold.text for g, e in zip(gold_ids, examples))
    assert len(load_nq_oracle(path, limit=5)) == 5


def test_kv_retrieval(shared_data):
    examples = load_kv_retrieval(shared_data / "lost_in_the_middle" / "kv-retrieval-75_keys.jsonl.gz")
    assert len(examples) == 500 and all(len(e.kv_records) == 75 for e in examples)
    e = examples[0]
    assert e.key == "2a8d601d-1d69-4e64-9f90-8ad825a74195" and e.value == "bb3ba2a5-7de8-434b-a86e-a88bb9fa7289"
    assert e.kv_records[e.gold_index] == (e.key, e.value)


def test_generated_universe_roundtrip(tmp_path):
    u = generate_universe(50, seed=2, num_questions=80)
    data = load_phantomwiki(u.save(tmp_path / "u"))
    assert [(a.title, a.article, list(a.facts)) for a in data.articles] == \
        [(a["title"], a["article"], a["facts"]) for a in u.articles]
    assert [(q.id, q.question, list(q.answer), q.hops, list(q.titles)) for q in data.questions] == \
        [(q["id"], q["question"], q["answer"], q["hops"], q["titles"]) for q in u.questions]
    assert not list((tmp_path / "u").glob(".*tmp"))  # no temp files left by the atomic write


def test_titles_derived_when_absent(tmp_path):
    """Without a titles field, titles come from the Prolog query and equal the generator's own."""
    u = generate_universe(50, seed=2, num_questions=80)
    for q in u.questions:
        del q["titles"]
    u.save(tmp_path / "u")
    data = load_phantomwiki(tmp_path / "u")
    fresh = generate_universe(50, seed=2, num_questions=80)
    assert [list(q.titles) for q in data.questions] == [q["titles"] for q in fresh.questions]
    assert all(q.titles is None for q in load_phantomwiki(tmp_path / "u", derive_titles=False).questions)


def _write(folder, articles, questions):
    folder.mkdir(exist_ok=True)
    (folder / "articles.json").write_text(articles if isinstance(articles, str) else json.dumps(articles))
    (folder / "questions.json").write_text(questions if isinstance(questions, str) else json.dumps(questions))
    return folder


ART = {"title": "Ann Lee", "article": "# Ann Lee\n", "facts": ['hobby("Ann Lee", "chess").']}
QUE = {"id": "q1", "question": "What is the hobby of Ann Lee?", "answer": ["chess"],
       "prolog": {"query": ['hobby("Ann Lee", Y_1)'], "answer": "Y_1"}}


def test_phantomwiki_errors(tmp_path):
    data = load_phantomwiki(_write(tmp_path / "ok", [ART], [QUE]))
    assert data.questions[0].titles == ("Ann Lee",) and data.questions[0].hops == 1
    with pytest.raises(FileNotFoundError, match="PhantomWiki folder .*nowhere not found"):
        load_phantomwiki(tmp_path / "nowhere")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "articles.json").write_text("[]")
    with pytest.raises(FileNotFoundError, match="questions file .*questions.json not found"):
        load_phantomwiki(tmp_path / "half")
    cases = [
        ("[{", [QUE], r"articles.json is not valid JSON"),
        ({"a": 1}, [QUE], r"articles.json must hold a JSON list, got dict"),
        ([{"title": "Ann Lee", "facts": []}], [QUE], r"articles.json record 0 has no field 'article'"),
        ([ART, ART], [QUE], r"duplicate article title 'Ann Lee'"),
        ([ART], [{**QUE, "answer": "chess"}], r"questions.json record 0 field 'answer' must be list, got str"),
        ([ART], [{**QUE, "answer": [1]}], r"field 'answer' must be a list of strings"),
        ([ART], [{**QUE, "hops": True}], r"field 'hops' must be int, got bool"),
        ([ART], [{k: v for k, v in QUE.items() if k != "prolog"}], r"none of 'hops', 'difficulty', 'prolog'"),
        ([ART], [{**QUE, "prolog": {"query": "x"}}], r"field 'prolog' must be"),
        ([{**ART, "facts": ["hobby(Ann, chess)."]}], [QUE], r"article 'Ann Lee': fact 'hobby\(Ann, chess\)\.' is not"),
    ]
    for i, (articles, questions, pattern) in enumerate(cases):
        with pytest.raises(ValueError, match=pattern):
            load_phantomwiki(_write(tmp_path / f"bad{i}", articles, questions))


def test_jsonl_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="NQ oracle file .*missing.jsonl.gz not found"):
        load_nq_oracle(tmp_path / "missing.jsonl.gz")
    (tmp_path / "notgz.jsonl.gz").write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="not a readable gzip JSONL file"):
        load_nq_oracle(tmp_path / "notgz.jsonl.gz")
    good = {"question": "q", "answers": ["a"], "ctxs": [{"title": "T", "text": "a b", "hasanswer": True, "isgold": True}]}
    lines = [json.dumps(good), "{oops", ""]
    with gzip.open(tmp_path / "nq.jsonl.gz", "wt") as f:
        f.write("\n".join(lines))
    assert len(load_nq_oracle(tmp_path / "nq.jsonl.gz", limit=1)) == 1
    with pytest.raises(ValueError, match="nq.jsonl.gz line 2 is not valid JSON"):
        load_nq_oracle(tmp_path / "nq.jsonl.gz")
    (tmp_path / "nq2.jsonl").write_text(json.dumps({**good, "ctxs": [{"title": "T"}]}) + "\n")
    with pytest.raises(ValueError, match=r"line 1 ctxs\[0\] has no field 'text'"):
        load_nq_oracle(tmp_path / "nq2.jsonl")
    with pytest.raises(ValueError, match="limit=-1"):
        load_nq_oracle(tmp_path / "nq.jsonl.gz", limit=-1)
    kv = {"ordered_kv_records": [["k1", "v1"], ["k2", "v2"]], "key": "k2", "value": "v9"}
    (tmp_path / "kv.jsonl").write_text(json.dumps(kv) + "\n")
    with pytest.raises(ValueError, match=r"\('k2', 'v9'\) is not among its ordered_kv_records"):
        load_kv_retrieval(tmp_path / "kv.jsonl")
    (tmp_path / "kv.jsonl").write_text(json.dumps({**kv, "value": "v2"}) + "\n")
    assert load_kv_retrieval(tmp_path / "kv.jsonl")[0].gold_index == 1


def test_shared_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_JAX_SHARED_DATA", str(tmp_path))
    assert loaders.shared_data_dir() == tmp_path
    monkeypatch.setenv("RAG_JAX_SHARED_DATA", str(tmp_path / "absent"))
    assert loaders.shared_data_dir() is None


def test_degenerate_files_load_as_empty_datasets(tmp_path):
    """Issue 27: an empty / blank JSONL file and a PhantomWiki folder of empty lists are valid empty datasets
    (documented in the module docstring), and a one-record file gives that one record."""
    for text in ("", "\n\n"):
        (tmp_path / "d.jsonl").write_text(text)
        assert load_nq_oracle(tmp_path / "d.jsonl") == [] and load_kv_retrieval(tmp_path / "d.jsonl") == []
    assert nq_passage_pool([]) == ([], [])
    (tmp_path / "pw").mkdir()
    for name in ("articles.json", "questions.json"):
        (tmp_path / "pw" / name).write_text("[]")
    data = load_phantomwiki(tmp_path / "pw")
    assert data.articles == () and data.questions == ()
    key, value = "k" + str(np.random.default_rng().integers(1 << 30)), "v"
    (tmp_path / "one.jsonl").write_text(json.dumps({"ordered_kv_records": [[key, value], ["a", "b"]], "key": key,
                                                    "value": value}) + "\n")
    (ex,) = load_kv_retrieval(tmp_path / "one.jsonl")
    assert (ex.key, ex.value) == (key, value)
