"""tfds builder: builds array_record without TensorFlow and reads back through tfds, grain and array_record."""
import importlib.util

import pytest

pytest.importorskip("tensorflow_datasets", reason="tensorflow-datasets is a project dependency; not installed here")

import grain  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402
from array_record.python.array_record_module import ArrayRecordReader  # noqa: E402

from rag_jax.data.loaders import load_phantomwiki  # noqa: E402
from rag_jax.data.phantom import generate_universe  # noqa: E402
from rag_jax.data.phantom_tfds import PhantomWikiConfig, decode, prepare  # noqa: E402


def test_no_tensorflow_needed():
    assert importlib.util.find_spec("tensorflow") is None, "this test checks the TF-free path; TF is installed"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


def test_questions_roundtrip(data_dir):
    builder = prepare(data_dir, "questions")  # registered config: 100 people, seed 0, 200 questions
    expected = {q["id"]: q for q in generate_universe(100, 0, 3, 200).questions}
    sources = tfds.data_source("phantom_wiki/questions", data_dir=str(data_dir))
    assert {k: len(v) for k, v in sources.items()} == {"train": 160, "test": 40}
    got = {}
    for split, src in sources.items():
        for i in range(len(src)):
            rec = decode(src[i])
            got[rec["id"]] = (split, rec)
    assert set(got) == set(expected)
    for qid, (_, rec) in got.items():
        q = expected[qid]
        assert rec == {k: q[k] for k in ("id", "question", "answer", "hops", "titles")}
    # The same files through array_record's own reader and the builder's feature spec.
    files = sorted(p for p in (data_dir / "phantom_wiki" / "questions" / "1.0.0").iterdir() if ".array_record" in p.name)
    assert len(files) == 2
    reader = ArrayRecordReader(str(next(f for f in files if "-test." in f.name)))
    assert reader.num_records() == 40
    raw = reader.read([0])[0]
    rec = decode(builder.info.features.deserialize_example_np(raw))
    assert got[rec["id"]] == ("test", rec)
    # grain reads the tfds data source directly.
    ds = grain.MapDataset.source(sources["train"]).map(decode)
    assert len(ds) == 160 and ds[5]["id"] in expected and got[ds[5]["id"]][0] == "train"


def test_articles_custom_config(data_dir):
    cfg = PhantomWikiConfig(name="articles_p60_s5", kind="articles", num_people=60, seed=5, num_questions=10)
    prepare(data_dir, cfg)
    src = tfds.builder_from_directory(str(data_dir / "phantom_wiki" / cfg.name / "1.0.0")).as_data_source()["train"]
    got = sorted((decode(src[i]) for i in range(len(src))), key=lambda a: a["title"])
    assert got == generate_universe(60, 5, 3, 10).articles


def test_local_source_folder(tmp_path, data_dir):
    folder = generate_universe(30, seed=9, num_questions=50).save(tmp_path / "universe")
    cfg = PhantomWikiConfig(name="local_questions", kind="questions", source_dir=str(folder), test_fraction=0.5)
    src = prepare(data_dir, cfg).as_data_source()
    assert len(src["train"]) == len(src["test"]) == 25
    expected = {q.id: q for q in load_phantomwiki(folder).questions}
    rec = decode(src["test"][3])
    q = expected[rec["id"]]
    assert (rec["question"], rec["answer"], rec["hops"], rec["titles"]) == (q.question, list(q.answer), q.hops, list(q.titles))


def test_bad_config():
    with pytest.raises(ValueError, match="kind='passages' must be one of"):
        PhantomWikiConfig(name="x", kind="passages")
    with pytest.raises(ValueError, match="test_fraction=1.0"):
        PhantomWikiConfig(name="x", test_fraction=1.0)
