"""Caches keyed by what they depend on (issue 27): after a model's weights change in place (``nnx.update``, as an
optimizer step or an evaluation hook does), Block-Attention's passage KV, GRIT's cached KV and EM-LLM's memory
miss (or refuse) instead of serving the old weights' KV; each result equals a fresh computation on the new
weights. Before issue 27 the first two served stale store hits and EM-LLM kept decoding with the old weights."""
import jax
import numpy as np
import pytest
from flax import nnx

from rag_jax.tokenizer import byte_tokenizer
from rag_jax.inference.block_attention import BlockAttention
from rag_jax.inference.grit_cache import GritCache
from rag_jax.inference.kv_store import KVStore, WeightsFingerprint, model_fingerprint
from rag_jax.memory import EMLLM, EMLLMConfig
from rag_jax.model import ModelConfig, Transformer

CFG = ModelConfig.tiny(max_seq_len=256, vocab_size=256)


def _model() -> Transformer:
    return Transformer(CFG, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30))))


def _update_in_place(model: Transformer, scale: float = 0.05) -> None:
    """An in-place weight change, as an optimizer step: every parameter moves by fresh noise."""
    rng = np.random.default_rng()
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x + scale * rng.standard_normal(x.shape).astype(x.dtype), params))


@pytest.mark.parametrize("given", [None, "checkpoint-7"])
def test_block_attention_misses_after_an_in_place_update(given):
    model = _model()
    ba = BlockAttention(model, store=KVStore(1 << 24), fingerprint=given)
    rng = np.random.default_rng()
    blocks = [rng.integers(1, CFG.vocab_size, int(n)).tolist() for n in rng.integers(3, 12, 3)]
    before = np.asarray(ba.prefill(blocks).logits)
    assert ba.store.stats["misses"] == 2
    _update_in_place(model)
    after = np.asarray(ba.prefill(blocks).logits)
    assert ba.store.stats["hits"] == 0 and ba.store.stats["misses"] == 4      # 2 stale hits before issue 27
    fresh = np.asarray(BlockAttention(model, store=KVStore(1 << 24)).prefill(blocks).logits)
    np.testing.assert_allclose(after, fresh, rtol=0, atol=1e-6)
    assert np.abs(after - before).max() > 1e-3                               # the update changed the answer
    again = np.asarray(ba.prefill(blocks).logits)                            # unchanged weights: hits again
    assert ba.store.stats["hits"] == 2
    np.testing.assert_array_equal(again, after)


def test_weights_fingerprint_follows_the_weights():
    model = _model()
    fp = WeightsFingerprint(nnx.split(model)[1], "cfg")
    first = fp()
    assert fp() == first and fp.changes == 0                                 # no change: no re-hash
    _update_in_place(model)
    assert fp() == model_fingerprint(nnx.state(model), "cfg") != first and fp.changes == 1


def test_grit_cache_misses_after_an_in_place_update():
    model = _model()
    tok = byte_tokenizer()
    grit = GritCache(model, tok, cache_attention="causal")
    query, doc = "who wrote it?", "".join(np.random.default_rng().choice(list("abcdef gh"), 40))
    grit.generate("doc", query, doc, max_new_tokens=2)
    _update_in_place(model)
    cache, prompt = grit.build("doc", query, doc)
    fresh_cache, fresh_prompt = GritCache(model, tok, cache_attention="causal").build("doc", query, doc)
    assert prompt == fresh_prompt
    assert grit.store.stats["hits"] == 0                                      # 1 stale hit before issue 27
    np.testing.assert_allclose(np.asarray(cache.k), np.asarray(fresh_cache.k), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(cache.v), np.asarray(fresh_cache.v), rtol=0, atol=1e-6)


def test_em_llm_stream_refuses_changed_weights_and_reset_reads_them():
    model = Transformer(CFG.replace(num_layers=2), rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30))))
    cfg = EMLLMConfig(n_init=4, n_local=32, n_mem=64, chunk_size=16, min_block_size=4, max_block_size=8)
    tokens = np.random.default_rng().integers(0, CFG.vocab_size, 60).astype(np.int32)
    em = EMLLM(model, cfg)
    em.prefill(tokens)
    _update_in_place(model)
    with pytest.raises(ValueError, match="weights changed since this EM-LLM stream started"):
        em.step(1)
    em.reset()
    np.testing.assert_allclose(em.prefill(tokens), EMLLM(model, cfg).prefill(tokens), rtol=0, atol=1e-6)
    fresh = EMLLM(model, cfg)                     # built before a change, nothing streamed: takes the new weights
    _update_in_place(model)
    np.testing.assert_allclose(fresh.prefill(tokens), EMLLM(model, cfg).prefill(tokens), rtol=0, atol=1e-6)


def test_frozen_bottom_table_is_emptied_after_an_in_place_update():
    """GRIT's frozen-bottom feature table (``rag-jax eval grit_pretrained``): a row precomputed before the bottom's
    weights changed is not served after (KeyError, as an unknown row); precomputed again it equals the bottom's
    own forward on the new weights. Before issue 27 the old features were returned."""
    import jax.numpy as jnp

    from rag_jax.train.frozen_bottom import FrozenBottom, split_model

    bottom, _ = split_model(Transformer(CFG.replace(num_layers=2), rngs=nnx.Rngs(3)), 1)
    frozen = FrozenBottom(bottom)
    row = np.random.default_rng().integers(0, CFG.vocab_size, 9).astype(np.int32)
    frozen.precompute("causal", [row], progress=False)
    before = frozen.features("causal", row)
    _update_in_place(bottom)
    with pytest.raises(KeyError, match="precompute it first"):
        frozen.features("causal", row)
    frozen.precompute("causal", [row], progress=False)
    t = jnp.asarray(row[None])
    want = bottom.residual(t, jnp.arange(9)[None], jnp.ones((1, 9), jnp.int32), mode="causal")[0]
    np.testing.assert_allclose(frozen.features("causal", row), np.asarray(want), atol=1e-5)
    assert np.abs(frozen.features("causal", row) - before).max() > 1e-3
