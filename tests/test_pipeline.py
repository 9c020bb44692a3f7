"""tfds ArrayRecord builder + grain pipeline: packing, seeded shuffling, host sharding, checkpointable state."""
import numpy as np
import pytest

from rag_jax.data import pipeline, text_tfds
from rag_jax.data.phantom import generate_universe
from rag_jax.tokenizer import load_tokenizer

VOCAB = 384


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tfds")
    tok_path = text_tfds.prepare_text_dataset("phantom_wiki/articles_p60_s0", data_dir, VOCAB)
    return data_dir, tok_path


def _cfg(data_dir, **kw):
    return pipeline.DataConfig(data_dir=str(data_dir), dataset="phantom_wiki/articles_p60_s0",
                               seq_len=kw.pop("seq_len", 96), num_packing_bins=kw.pop("num_packing_bins", 3), **kw)


def test_builder_writes_array_record_and_holds_out_articles(prepared):
    data_dir, _ = prepared
    builder = text_tfds.builder("phantom_wiki/articles_p60_s0", data_dir)
    assert any(".array_record-" in p.name for p in builder.data_path.iterdir())
    train, held_out = (text_tfds.data_source("phantom_wiki/articles_p60_s0", data_dir, s)
                       for s in ("train", "validation"))
    articles = {a["title"]: a["article"] for a in generate_universe(num_people=60, seed=0, num_questions=0).articles}
    assert len(held_out) == 6 and len(train) + len(held_out) == len(articles) == 60
    train_text = {train[i]["title"].decode(): train[i]["article"].decode() for i in range(len(train))}
    held_titles = {held_out[i]["title"].decode() for i in range(len(held_out))}
    assert held_titles.isdisjoint(train_text) and held_titles | set(train_text) == set(articles)
    assert all(articles[t] == text for t, text in train_text.items())


def _documents(data_dir, tok_path, split="train"):
    tok = load_tokenizer(tok_path)
    src = text_tfds.data_source("phantom_wiki/articles_p60_s0", data_dir, split)
    bos, eos = tok.token_to_id("<bos>"), tok.token_to_id("<eos>")
    return [tuple([bos] + tok.encode(src[i]["article"].decode()).ids + [eos]) for i in range(len(src))]


def _segments(batch):
    """Each row's (segment_id, tokens, positions) runs, in order."""
    out = []
    for tokens, seg, pos in zip(batch["tokens"], batch["segment_ids"], batch["positions"]):
        for s in np.unique(seg[seg > 0]):
            idx = np.flatnonzero(seg == s)
            assert np.all(np.diff(idx) == 1), "a segment must be contiguous"
            out.append((tuple(tokens[idx]), tuple(pos[idx])))
        assert np.all(tokens[seg == 0] == 0) and np.all(pos[seg == 0] == 0)
    return out


def test_packed_rows_hold_whole_tokenized_documents(prepared):
    data_dir, tok_path = prepared
    docs = _documents(data_dir, tok_path, "validation")
    assert max(map(len, docs)) < 400  # every document fits a row whole
    cfg = _cfg(data_dir, seq_len=400)
    it = iter(pipeline.make_lm_dataset(cfg, split="validation", global_batch=2, tokenizer_path=tok_path,
                                       shuffle=False))
    seen, max_segments = [], 0
    for _ in range(3):
        batch = next(it)
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
            k: ((2, 400), np.dtype(np.int32)) for k in ("tokens", "positions", "segment_ids")}
        for tokens, positions in _segments(batch):
            assert positions == tuple(range(len(tokens)))  # positions restart in every document
            seen.append(tokens)
        max_segments = max(max_segments, batch["segment_ids"].max())
    assert max_segments >= 2  # rows really are packed with several documents
    assert set(seen) <= set(docs)
    assert set(docs) <= set(seen)  # 3 batches of 2 rows cover the 6 held-out articles (repeated epochs)


def test_long_documents_are_cut_into_rows(prepared):
    data_dir, tok_path = prepared
    docs = set(_documents(data_dir, tok_path))
    it = iter(pipeline.make_lm_dataset(_cfg(data_dir, seq_len=64), split="train", global_batch=4,
                                       tokenizer_path=tok_path))
    for _ in range(4):
        for tokens, positions in _segments(next(it)):
            assert len(tokens) <= 64 and positions == tuple(range(len(tokens)))
            assert any(tokens == d[i:i + len(tokens)] for d in docs for i in range(0, len(d), 64))


def _take(ds, n):
    it = iter(ds)
    return [next(it) for _ in range(n)]


def _same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_shuffle_is_seeded(prepared):
    data_dir, tok_path = prepared
    make = lambda seed: pipeline.make_lm_dataset(_cfg(data_dir, shuffle_seed=seed), split="train", global_batch=2,
                                                 tokenizer_path=tok_path)
    assert _same(_take(make(0), 3), _take(make(0), 3))
    assert not _same(_take(make(0), 3), _take(make(1), 3))


def test_host_shards_assemble_the_same_global_batch(prepared):
    """With a fixed num_shards, rows fed by 2 "hosts" equal the 1-host global batch row for row."""
    data_dir, tok_path = prepared
    cfg = _cfg(data_dir, num_shards=2)
    full = _take(pipeline.make_lm_dataset(cfg, split="train", global_batch=4, tokenizer_path=tok_path), 3)
    halves = [_take(pipeline.make_lm_dataset(cfg, split="train", global_batch=4, tokenizer_path=tok_path,
                                             row_range=r), 3) for r in ((0, 2), (2, 4))]
    for f, h0, h1 in zip(full, *halves):
        for k in f:
            np.testing.assert_array_equal(f[k], np.concatenate([h0[k], h1[k]]))
    # the two shards read disjoint documents
    first, second = ({t for t, _ in _segments(h[0])} for h in halves)
    assert first.isdisjoint(second)
    with pytest.raises(ValueError, match="must be divisible by data.num_shards=3"):
        pipeline.make_lm_dataset(_cfg(data_dir, num_shards=3), split="train", global_batch=4, tokenizer_path=tok_path)
    with pytest.raises(ValueError, match="do not align with data shards"):
        pipeline.make_lm_dataset(cfg, split="train", global_batch=4, tokenizer_path=tok_path, row_range=(0, 1))


def test_iterator_state_resumes_exactly(prepared):
    data_dir, tok_path = prepared
    ds = pipeline.make_lm_dataset(_cfg(data_dir, num_shards=2), split="train", global_batch=4,
                                  tokenizer_path=tok_path)
    it = iter(ds)
    for _ in range(5):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(4)]
    resumed = iter(ds)
    resumed.set_state(state)
    assert _same(expected, [next(resumed) for _ in range(4)])


def test_missing_dataset_is_a_clear_error(tmp_path):
    cfg = pipeline.DataConfig(data_dir=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"dataset directory .*nowhere.* does not exist; run .*prepare_data"):
        pipeline.check_dataset(cfg, 512)
    with pytest.raises(FileNotFoundError, match="data.data_dir is not set"):
        pipeline.check_dataset(pipeline.DataConfig(), 512)
    with pytest.raises(ValueError, match="dataset 'c4' is not known"):
        text_tfds.builder("c4", tmp_path)
    with pytest.raises(ValueError, match="split='test'"):
        text_tfds.SplitView([], "test")
