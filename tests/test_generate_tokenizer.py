"""Generation features (EOS, sampling, ragged batches, prefix caches) and BPE tokenizer training."""
import numpy as np
import pytest
from flax import nnx

from rag_jax.tokenizer import byte_tokenizer, load_tokenizer, save_tokenizer, train_bpe
from rag_jax.inference.generate import generate
from rag_jax.model import ModelConfig, Transformer


@pytest.fixture(scope="module")
def model():
    return Transformer(ModelConfig.tiny(vocab_size=200, max_seq_len=96), rngs=nnx.Rngs(0))


def test_ragged_batch_equals_one_by_one(model):
    r = np.random.default_rng(0)
    prompts = [r.integers(0, 200, n).tolist() for n in (5, 17, 9)]
    batched = generate(model, prompts, max_new_tokens=6)
    for i, p in enumerate(prompts):
        np.testing.assert_array_equal(batched[i], generate(model, [p], max_new_tokens=6)[0])


def test_eos_stops_and_fills(model):
    p = np.random.default_rng(1).integers(0, 200, (1, 8))
    free = generate(model, p, max_new_tokens=10)[0]
    eos = int(free[3])
    out = generate(model, p, max_new_tokens=10, eos_id=eos)[0]
    first = int(np.argmax(out == eos))
    np.testing.assert_array_equal(out[: first + 1], free[: first + 1])
    assert (out[first:] == eos).all()


def test_sampling_is_seeded_and_respects_top_k(model):
    p = np.random.default_rng(2).integers(0, 200, (2, 8))
    a = generate(model, p, max_new_tokens=8, temperature=1.0, top_k=1, seed=3)
    np.testing.assert_array_equal(a, generate(model, p, max_new_tokens=8))  # top_k=1 == greedy
    s1 = generate(model, p, max_new_tokens=8, temperature=1.5, top_p=0.9, seed=1)
    s2 = generate(model, p, max_new_tokens=8, temperature=1.5, top_p=0.9, seed=1)
    np.testing.assert_array_equal(s1, s2)
    assert not np.array_equal(generate(model, p, max_new_tokens=8, temperature=1.5, seed=2), s1)


def test_prefix_kv_cache_equals_full_prompt(model):
    import jax.numpy as jnp
    p = np.random.default_rng(4).integers(0, 200, (2, 20))
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
    prefix = model(jnp.asarray(p[:, :12]), pos, jnp.ones((2, 12), jnp.int32)).kv
    np.testing.assert_array_equal(generate(model, p[:, 12:], max_new_tokens=5, kv_cache=prefix),
                                  generate(model, p, max_new_tokens=5))


def test_generate_bad_input(model):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1, 2], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="exceeds max_seq_len=96"):
        generate(model, [[1] * 90], max_new_tokens=10)
    with pytest.raises(ValueError, match="token id 200"):
        generate(model, [[1, 200]], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p=1.5"):
        generate(model, [[1, 2]], max_new_tokens=2, temperature=1.0, top_p=1.5)


def test_train_bpe_roundtrip(tmp_path):
    texts = [f"Alice {i} lives in Paris and likes chess number {i * 7}." for i in range(200)]
    tok = train_bpe(texts, vocab_size=400, save_path=tmp_path)
    again = load_tokenizer(tmp_path)
    ids = again.encode("Alice lives in Paris — ünïcode ok").ids
    assert again.decode(ids) == "Alice lives in Paris — ünïcode ok"
    assert tok.token_to_id("<pad>") == 0 and tok.token_to_id("<eos>") == 2
    assert len(tok.encode(texts[0]).ids) < len(texts[0]) / 2  # merges were learned
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        train_bpe(texts, vocab_size=100)


def test_byte_tokenizer_ids_are_utf8_bytes(tmp_path):
    """``byte_tokenizer`` (byte-level run folders): ids == UTF-8 bytes, decode inverts, survives tokenizer.json."""
    rng = np.random.default_rng()
    text = "".join(chr(c) for c in rng.integers(1, 0x2FFF, 300)) + " é\n\t☃ The pass key is:12345."
    tok = load_tokenizer(save_tokenizer(byte_tokenizer(), tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 256
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


@pytest.mark.parametrize("window", [None, 5])
def test_decode_step_equals_the_whole_sequence_forward(window):
    """``Transformer.decode`` over a ``DecodeCache`` (keys rotated once, heads first) gives the logits of the
    whole-sequence causal forward at each new token, for left-padded ragged rows and with sliding-window
    layers; the cache it returns holds the new token's rotated key at its slot; several tokens per call (a
    verification step) give the same logits and cache."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from rag_jax.inference.generate import prefill
    from rag_jax.model.kv import DecodeCache
    from rag_jax.model.rope import apply_rope

    cfg = dataclasses.replace(ModelConfig.tiny(vocab_size=200, max_seq_len=96), sliding_window=window,
                              dtype="float32")
    m = Transformer(cfg, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 20))))
    rng = np.random.default_rng()
    b, s, new = 3, 12, 4
    tokens = rng.integers(0, 200, (b, s + new)).astype(np.int32)
    pad = np.array([0, 3, 7])                                        # left padding per row
    seg = (np.arange(s + new)[None] >= pad[:, None]).astype(np.int32)
    pos = np.maximum(np.cumsum(seg, axis=1) - 1, 0).astype(np.int32)
    whole = m(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)).logits
    logits, cache, slot = prefill(m, jnp.asarray(tokens[:, :s]), jnp.asarray(pos[:, :s]), jnp.asarray(seg[:, :s]),
                                  None, new)
    assert isinstance(cache, DecodeCache) and slot == s and cache.length == s + new
    np.testing.assert_allclose(logits, whole[:, s - 1], atol=2e-5, rtol=2e-5)
    step = jax.jit(lambda c, t, p, i: m.decode(t, p, c, i))
    for t in range(new):
        logits, cache = step(cache, jnp.asarray(tokens[:, s + t]), jnp.asarray(pos[:, s + t]), jnp.int32(s + t))
        np.testing.assert_allclose(logits, whole[:, s + t], atol=2e-5, rtol=2e-5)
    x = m(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)).kv.k[-1][:, -1:]   # pre-RoPE key
    np.testing.assert_allclose(np.asarray(cache.k[-1])[:, :, -1], np.asarray(apply_rope(
        x, jnp.asarray(pos[:, -1:]), m.inv_freq))[:, 0], atol=1e-5)
    np.testing.assert_array_equal(cache.segment_ids, (np.arange(s + new)[None] >= pad[:, None]))
    # the same new tokens in one call ([batch, s] tokens: a speculative verification step), then split 1 + 3
    _, start, _ = prefill(m, jnp.asarray(tokens[:, :s]), jnp.asarray(pos[:, :s]), jnp.asarray(seg[:, :s]), None, new)
    many, cache2 = m.decode(jnp.asarray(tokens[:, s:]), jnp.asarray(pos[:, s:]), start, jnp.int32(s))
    np.testing.assert_allclose(many, whole[:, s:], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(cache2.k[-1]), np.asarray(cache.k[-1]), atol=1e-5)
    one, part = m.decode(jnp.asarray(tokens[:, s]), jnp.asarray(pos[:, s]), start, jnp.int32(s))
    rest, _ = m.decode(jnp.asarray(tokens[:, s + 1:]), jnp.asarray(pos[:, s + 1:]), part, jnp.int32(s + 1))
    np.testing.assert_allclose(np.concatenate([np.asarray(one)[:, None], rest], 1), whole[:, s:], atol=2e-5,
                               rtol=2e-5)
