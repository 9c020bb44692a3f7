"""Flax BERT (rag_jax.model.bert) + BertEmbedder vs sentence-transformers on the real all-MiniLM-L6-v2."""
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # sentence-transformers must read the local package folder, never a hub

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from rag_jax.model.bert import BertConfig, load_bert  # noqa: E402
from rag_jax.retrieval.embedders import BertEmbedder, embed_texts, minilm_dir  # noqa: E402

# 50 varied inputs: lengths from 1 token to past max_seq_length=256 (truncation), casing, punctuation,
# digits, accents, non-Latin scripts, emoji, code, whitespace-only and empty strings.
SENTENCES = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the street corner while people pass by.",
    "Who wrote the novel Pride and Prejudice?",
    "Jane Austen published Pride and Prejudice in 1813.",
    "The mitochondria is the powerhouse of the cell.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "What is the capital of Australia?",
    "Canberra is the capital city of Australia, not Sydney.",
    "I love eating pizza with extra cheese on Friday nights.",
    "Stock markets fell sharply after the central bank raised interest rates by 50 basis points.",
    "The patient was prescribed 20 mg of atorvastatin once daily.",
    "def add(a, b):\n    return a + b",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY name;",
    "E = mc^2 relates mass and energy.",
    "Café au lait, naïve façade, résumé, coöperate.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "El rápido zorro marrón salta sobre el perro perezoso.",
    "素早い茶色の狐が怠惰な犬を飛び越える。",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "🙂🚀 emojis are tokens too 🎉",
    "OK",
    "a",
    "",
    "   ",
    "THIS SENTENCE IS WRITTEN ENTIRELY IN CAPITAL LETTERS FOR EMPHASIS.",
    "this sentence is written entirely in lower case letters.",
    "Is it raining? No... maybe; well — it's complicated!!!",
    "The 2024 Summer Olympics were held in Paris, France, from 26 July to 11 August.",
    "Neural networks learn representations through gradient descent on a loss function.",
    "Retrieval-augmented generation grounds language models in external documents.",
    "The Great Wall of China is visible from low Earth orbit only under ideal conditions.",
    "My phone number is 555-0199 and my zip code is 90210.",
    "https://example.com/path?query=1&other=two#anchor",
    "user@example.org wrote: 'see attached file report_v2.pdf'",
    "Water boils at 100 degrees Celsius at sea level.",
    "The cat sat on the mat. The dog sat on the log. The bird sat on the word.",
    "Quantum entanglement does not allow faster-than-light communication.",
    "He said, \"I'll be back,\" and left without another word.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15",
    "Tokyo, New York, London, Paris, Berlin, Madrid, Rome, Beijing, Moscow.",
    "Vaccines train the immune system to recognize pathogens.",
    "The defendant pleaded not guilty to all charges on Monday.",
    "Add two cups of flour, one egg and a pinch of salt, then whisk.",
    "Antidisestablishmentarianism is a famously long English word.",
    "The sun rises in the east and sets in the west.",
    "Machine translation quality has improved dramatically since 2016.",
    ("A long passage that exceeds the maximum sequence length so that truncation is exercised. " * 30).strip(),
    ("Shorter but still lengthy text about history, science, art and music, repeated. " * 8).strip(),
    "The end.",
]


@pytest.fixture(scope="module")
def embedder():
    return BertEmbedder(batch_size=32)


def test_minilm_matches_sentence_transformers(embedder):
    from sentence_transformers import SentenceTransformer
    assert len(SENTENCES) == 50
    reference = SentenceTransformer(str(minilm_dir()), device="cpu")
    assert reference.max_seq_length == embedder.max_length == 256
    want = reference.encode(SENTENCES, batch_size=32, convert_to_numpy=True, normalize_embeddings=False)
    got = embedder.embed(SENTENCES)
    assert got.dtype == np.float32 and got.shape == (50, 384)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cos = np.sum(got * want, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.9999, f"worst sentence {SENTENCES[int(cos.argmin())]!r}: cosine {cos.min()}"
    # Batch composition must not change a text's embedding (padding is masked out).
    alone = embedder.embed([SENTENCES[3]])
    np.testing.assert_allclose(alone[0], got[3], atol=1e-5)
    # The truncated long input equals its own first 256 tokens.
    assert len(embedder.tokenize([SENTENCES[47]])[0]) == 256


def test_embed_texts_chunks_and_validates(embedder):
    full = embedder.embed(SENTENCES[:7])
    chunked = embed_texts(embedder, SENTENCES[:7], chunk_size=3, progress=False)
    np.testing.assert_allclose(chunked, full, atol=1e-5)
    assert embed_texts(embedder, [], progress=False).shape == (0, 384)
    assert embedder.embed([]).shape == (0, 384)
    with pytest.raises(TypeError, match="not one string"):
        embedder.embed("a single string")
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        embedder.embed(["ok", 3])

    class Broken:
        dim = 4

        def embed(self, texts):
            return np.full((len(texts), 4), np.nan, np.float32)
    with pytest.raises(ValueError, match="NaN"):
        embed_texts(Broken(), ["x"], progress=False)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_bert(tmp_path)
    cfg = json.loads((minilm_dir() / "config.json").read_text())
    with pytest.raises(ValueError, match="model_type"):
        BertConfig.from_hf(dict(cfg, model_type="llama"))
    with pytest.raises(ValueError, match="hidden_act"):
        BertConfig.from_hf(dict(cfg, hidden_act="relu"))
    with pytest.raises(ValueError, match="multiple of num_heads"):
        BertConfig(hidden_size=100, num_heads=12)
    # A checkpoint whose config disagrees with its tensors names the tensor.
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, hidden_size=768, intermediate_size=3072)))
    (tmp_path / "model.safetensors").symlink_to(minilm_dir() / "model.safetensors")
    with pytest.raises(ValueError, match="embeddings.*shape"):
        load_bert(tmp_path)
    with pytest.raises(ValueError, match="max_length"):
        BertEmbedder(max_length=1000)
