"""Corpus store (chunking, persistence, errors) and the retrieval CLI (build from a config, query)."""
import json

import numpy as np
import pytest
import tokenizers

from rag_jax.retrieval import cli
from rag_jax.retrieval.corpus import Corpus, Document
from rag_jax.retrieval.embedders import minilm_dir
from rag_jax.retrieval.exact import ExactIndex
from rag_jax.retrieval.pipeline import Retriever

DOCS = [
    {"id": "volcano", "title": "Volcanoes",
     "text": "A volcano is a rupture in the crust of a planet that allows hot lava, volcanic ash and gases to "
             "escape from a magma chamber below the surface. Mount Etna in Sicily is one of the most active "
             "volcanoes in the world."},
    {"id": "violin", "title": "Violin",
     "text": "The violin is a wooden string instrument with four strings tuned in perfect fifths, played with a "
             "bow. Antonio Stradivari built famous violins in Cremona."},
    {"id": "bread", "title": "Bread",
     "text": "Bread is baked from a dough of flour and water, usually leavened with yeast that makes the dough "
             "rise before it goes into the oven."},
    {"id": "chess", "title": "Chess",
     "text": "Chess is a board game for two players on a checkered board of 64 squares; the goal is to "
             "checkmate the opponent's king."},
    {"id": "moon", "title": "Moon",
     "text": "The Moon is Earth's only natural satellite. Neil Armstrong first walked on the lunar surface in "
             "July 1969 during the Apollo 11 mission."},
]


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizers.Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))


def test_token_windows_cover_the_text_with_overlap(tokenizer, tmp_path):
    text = " ".join(f"word{i}" for i in range(200))
    corpus = Corpus.from_documents([{"id": "a", "title": "T", "text": text}, {"text": "short one"}],
                                   chunk_tokens=40, overlap=8, tokenizer=tokenizer)
    chunks = corpus.chunks
    doc_chunks = [c for c in chunks if c.doc_id == "a"]
    counter = tokenizers.Tokenizer.from_str(tokenizer.to_str())
    counter.no_padding()
    counter.no_truncation()
    offsets = counter.encode(text, add_special_tokens=False).offsets
    # MiniLM's tokenizer.json truncates at 128 tokens and pads: chunking must not inherit either.
    assert tokenizer.truncation["max_length"] == 128 and len(offsets) > 128
    # Window w covers document tokens [32 w, 32 w + 40) (stride = 40 - 8), the last one reaching the end.
    assert len(doc_chunks) == 1 + -(-(len(offsets) - 40) // 32)
    for w, c in enumerate(doc_chunks):
        window = offsets[32 * w:32 * w + 40]
        assert (c.start, c.end) == (window[0][0], window[-1][1]) and c.text == text[c.start:c.end]
    assert doc_chunks[0].start == 0 and doc_chunks[-1].end == len(text)
    for a, b in zip(doc_chunks, doc_chunks[1:]):  # consecutive windows overlap
        assert b.start < a.end and text[b.start:a.end].strip()
    assert chunks[-1].doc_id == "1" and chunks[-1].text == "short one" and chunks[-1].contents == "short one"
    assert doc_chunks[0].contents.startswith("T\nword0")
    assert corpus.doc_of_chunk([0, len(chunks) - 1, -1]) == [0, 1, -1]
    one_each = Corpus.from_documents([Document("x", "X", "alpha beta"), Document("y", "", "gamma")])
    assert [c.text for c in one_each.chunks] == ["alpha beta", "gamma"]

    corpus.save(tmp_path / "c")
    loaded = Corpus.load(tmp_path / "c")
    assert loaded.chunks == chunks and loaded.documents == corpus.documents


def test_corpus_bad_input(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="empty corpus"):
        Corpus.from_documents([])
    with pytest.raises(ValueError, match="empty text"):
        Corpus.from_documents([{"id": "a", "text": "  "}])
    with pytest.raises(ValueError, match="duplicate document id 'a'"):
        Corpus.from_documents([{"id": "a", "text": "x"}, {"id": "a", "text": "y"}])
    with pytest.raises(ValueError, match="overlap=5"):
        Corpus.from_documents([{"text": "x"}], chunk_tokens=5, overlap=5, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        Corpus.from_documents([{"text": "x"}], chunk_tokens=5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match="bad.jsonl:2: invalid JSON"):
        Corpus.read_documents(bad)
    bad.write_text('{"body": "no text field"}\n')
    with pytest.raises(ValueError, match="no 'text' field"):
        Corpus.read_documents(bad)
    with pytest.raises(FileNotFoundError):
        Corpus.load(tmp_path / "missing")


def test_cli_build_and_query(tmp_path, capsys):
    corpus_file = tmp_path / "docs.jsonl"
    corpus_file.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    config = tmp_path / "retrieval.yaml"
    config.write_text(f"corpus:\n  path: {corpus_file}\n  chunk_tokens: 24\n  overlap: 4\n"
                      f"index:\n  type: exact\noutput: {tmp_path / 'out'}\n")
    cli.main(["build", "--config", str(config), "--no-progress"])
    cli.main(["query", str(tmp_path / "out"), "Who first walked on the moon?", "how is bread made", "-k", "3",
              "--json"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["hits"][0]["doc_id"] for r in lines] == ["moon", "bread"]
    assert len(lines[0]["hits"]) == 3 and lines[0]["hits"][0]["score"] > lines[0]["hits"][1]["score"]

    # Same corpus through the ScaNN index via overrides; the retriever agrees with exact search.
    cli.main(["build", "--config", str(config), "index.type=scann", "index.scann.num_neighbors=5",
              f"output={tmp_path / 'out_scann'}", "--no-progress"])
    exact = Retriever.load(tmp_path / "out").search(["a stringed instrument played with a bow"], 4)
    scann = Retriever.load(tmp_path / "out_scann").search(["a stringed instrument played with a bow"], 4)
    assert exact[0][0]["doc_id"] == "violin"
    assert [h["chunk"] for h in scann[0]] == [h["chunk"] for h in exact[0]]
    np.testing.assert_allclose([h["score"] for h in scann[0]], [h["score"] for h in exact[0]], atol=1e-5)


def test_cli_config_errors(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(f"corpus:\n  path: x.jsonl\noutput: {tmp_path / 'o'}\n")
    with pytest.raises(ValueError, match="unknown config key 'corpus.chunk_size'"):
        cli.load_config(config, ["corpus.chunk_size=3"])
    with pytest.raises(ValueError, match="set twice"):
        cli.load_config(config, ["index.type=exact", "index.type=scann"])
    with pytest.raises(ValueError, match="index.type='faiss'"):
        cli.load_config(config, ["index.type=faiss"])
    with pytest.raises(ValueError, match="unknown config key 'index.scann.leaves'.*Valid keys"):
        cli.load_config(config, ["index.scann.leaves=3"])
    with pytest.raises(ValueError, match="corpus.path is required"):
        cli.load_config(None, [f"output={tmp_path}"])
    cfg = cli.load_config(config, ["index.scann.mode=ah", "index.scann.reorder_num_neighbors=50"])
    assert (cfg["index"]["scann"]["mode"], cfg["index"]["scann"]["reorder_num_neighbors"]) == ("ah", 50)


def test_cli_with_grit_decoder_embedder(tmp_path, capsys):
    """A rag-jax decoder in GRIT embedding mode plugs in: documents without, queries with the instruction."""
    from flax import nnx

    from rag_jax.tokenizer import save_tokenizer, train_bpe
    from rag_jax.model import ModelConfig, Transformer
    from rag_jax.model.embedding import GritEmbedder
    from rag_jax.model.hf import save_hf
    from rag_jax.retrieval.exact import ExactIndex

    texts = [f"{d['title']}\n{d['text']}" for d in DOCS]
    tok = train_bpe(texts * 4, vocab_size=400)
    save_tokenizer(tok, tmp_path / "tok")
    model = Transformer(ModelConfig.tiny(), rngs=nnx.Rngs(0))
    save_hf(model, tmp_path / "ckpt")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    cfg = cli.load_config(None, [f"corpus.path={tmp_path / 'docs.jsonl'}", f"output={tmp_path / 'out'}",
                                 "embedder.type=grit", f"embedder.path={tmp_path / 'ckpt'}",
                                 f"embedder.tokenizer={tmp_path / 'tok'}", "embedder.max_length=96",
                                 "embedder.query_instruction=Find the article", "index.type=exact"])
    cli.build(cfg, progress=False)
    hits = Retriever.load(tmp_path / "out").search(["moon landing"], 3)[0]
    # Reference: the same embeddings computed directly, searched exactly.
    reference = GritEmbedder(model, tok, max_length=96)
    docs_emb = reference.embed(texts)
    query_emb = reference.embed(["moon landing"], instruction="Find the article")
    ref = ExactIndex(docs_emb.shape[1])
    ref.add(docs_emb, np.arange(len(texts)))
    scores, ids = ref.search(query_emb, 3)
    assert [h["chunk"] for h in hits] == ids[0].tolist()
    np.testing.assert_allclose([h["score"] for h in hits], scores[0], atol=1e-5)


def test_retriever_from_texts_equals_the_index_it_builds():
    """The pipeline the demo uses: embed, index, search; the same ids and scores as the index searched by hand."""
    rng = np.random.default_rng()
    table = {}

    def embed(texts):
        out = np.stack([table.setdefault(t, rng.standard_normal(8).astype(np.float32)) for t in texts])
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    docs = [f"doc {i}" for i in range(20)]
    retriever = Retriever.from_texts(docs, embed, embed, lambda dim: ExactIndex(dim))
    scores, ids = retriever.search_ids(["doc 3", "doc 11"], 4)
    assert ids[:, 0].tolist() == [3, 11] and np.allclose(scores[:, 0], 1.0, atol=1e-5)
    by_hand = ExactIndex(8)
    by_hand.add(embed(docs), np.arange(20))
    want_scores, want_ids = by_hand.search(embed(["doc 3", "doc 11"]), 4)
    assert ids.tolist() == want_ids.tolist() and np.allclose(scores, want_scores)
    with pytest.raises(ValueError, match="no corpus"):
        retriever.search(["doc 3"], 2)
