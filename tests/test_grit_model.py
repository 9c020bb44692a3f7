"""GRIT on the core model: embedding mode (bidirectional, instruction-free mean pooling, fp32 unit norm),
the unified loss_fn in one jitted step (single device and shard_map on 8 devices), and RAG caching modes."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rag_jax import sharding

from rag_jax.tokenizer import train_bpe
from rag_jax.inference.grit_cache import GritCache
from rag_jax.inference.kv_store import KVStore
from rag_jax.model import ModelConfig, Transformer
from rag_jax.model.embedding import GritEmbedder, GritFormat, encode, mean_pool_normalize, tokenize_for_embedding
from rag_jax.train import step as step_lib
from rag_jax.train.objectives.grit import GritConfig, GritLoss, info_nce, next_token_loss

WORDS = ("alpha beta gamma delta river mountain city music paper science answer question retrieve "
         "represent document query the a of in is was who what where").split()


@pytest.fixture(scope="module")
def tokenizer():
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, 12)) for _ in range(200)]
    texts += ["<|user|>\n<|embed|>\n<|assistant|>\nThe answer is Answer the prior query"] * 20
    return train_bpe(texts, 400, special_tokens=("<pad>", "<s>", "</s>", "<unk>"))


@pytest.fixture(scope="module")
def model():
    return Transformer(ModelConfig.tiny(), rngs=nnx.Rngs(0))


# Jitted wrappers: one compile per shape instead of op-by-op dispatch (keeps the tests fast).
jencode = jax.jit(encode, static_argnames="mode")


@functools.partial(jax.jit, static_argnames="mode")
def forward(model, tokens, positions, segment_ids, mode="causal", kv_cache=None):
    return model(tokens, positions, segment_ids, mode=mode, kv_cache=kv_cache)


def rand_tokens(rng, b, s, vocab=512):
    return jnp.asarray(rng.integers(4, vocab, (b, s)), jnp.int32)


def test_embedding_is_bidirectional_and_generation_causal(model):
    """Same weights: in embedding mode an earlier token's state depends on later tokens; in the
    generative (causal) pass it does not."""
    rng = np.random.default_rng(1)
    tokens = rand_tokens(rng, 2, 10)
    changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % 512)
    ones = jnp.ones_like(tokens)
    _, bi = jencode(model, tokens, ones, ones)
    _, bi2 = jencode(model, changed, ones, ones)
    assert float(jnp.abs(bi.hidden[:, :7] - bi2.hidden[:, :7]).max()) > 1e-4
    pos = jnp.broadcast_to(jnp.arange(10), tokens.shape)
    ca, ca2 = forward(model, tokens, pos, ones), forward(model, changed, pos, ones)
    np.testing.assert_array_equal(np.asarray(ca.hidden[:, :7]), np.asarray(ca2.hidden[:, :7]))
    assert float(jnp.abs(ca.hidden - bi.hidden).max()) > 1e-4  # the modes really differ on the same weights
    # Padding is the only mask in embedding mode: right padding does not change the real tokens' states.
    padded = jnp.concatenate([tokens, rand_tokens(rng, 2, 6)], axis=1)
    attn = jnp.concatenate([ones, jnp.zeros((2, 6), jnp.int32)], axis=1)
    _, bp = jencode(model, padded, attn, attn)
    np.testing.assert_allclose(np.asarray(bp.hidden[:, :10]), np.asarray(bi.hidden), atol=1e-5)


def test_pooling_matches_numpy_and_excludes_instruction(model):
    rng = np.random.default_rng(2)
    tokens = rand_tokens(rng, 3, 12)
    attn = np.ones((3, 12), np.int32)
    attn[1, 9:] = 0
    pool = attn.copy()
    pool[:, :4] = 0  # 4 instruction/format tokens: attended, not pooled
    reps, out = jencode(model, tokens, jnp.asarray(attn), jnp.asarray(pool))
    h = np.asarray(out.hidden, np.float64)
    ref = (h * pool[..., None]).sum(1) / pool.sum(1, keepdims=True)
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(reps), ref, atol=1e-5)
    assert reps.dtype == jnp.float32
    np.testing.assert_allclose(np.linalg.norm(np.asarray(reps), axis=1), 1.0, atol=1e-6)
    # Including the instruction tokens in the mean would give another vector.
    with_instr = (h * attn[..., None]).sum(1) / attn.sum(1, keepdims=True)
    with_instr /= np.linalg.norm(with_instr, axis=1, keepdims=True)
    assert np.abs(with_instr - ref).max() > 1e-3
    # The instruction is still attended: changing it changes the pooled sample embedding.
    other = tokens.at[:, 1].set((tokens[:, 1] + 5) % 512)
    reps2, _ = jencode(model, other, jnp.asarray(attn), jnp.asarray(pool))
    assert float(jnp.abs(reps2 - reps).max()) > 1e-4


def test_bf16_model_pools_in_fp32(model):
    cfg = ModelConfig.tiny(dtype="bfloat16")
    m16 = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(3)
    tokens = rand_tokens(rng, 2, 8)
    ones = jnp.ones_like(tokens)
    reps, out = jencode(m16, tokens, ones, ones)
    assert out.hidden.dtype == jnp.bfloat16 and reps.dtype == jnp.float32
    ref = np.asarray(out.hidden, np.float64).mean(1)
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(reps), ref, atol=1e-6)
    np.testing.assert_allclose(np.asarray(jnp.linalg.norm(mean_pool_normalize(out.hidden, ones), axis=1)), 1.0,
                               atol=1e-6)


def test_tokenize_pool_mask_covers_exactly_the_text(tokenizer):
    fmt = GritFormat()
    ids, pool = tokenize_for_embedding(tokenizer, "river city music", "Represent the query", max_len=64)
    assert tokenizer.decode(ids[pool == 1].tolist(), skip_special_tokens=False) == "river city music"
    assert tokenizer.decode(ids[pool == 0].tolist(), skip_special_tokens=False) == fmt.embed_prefix(
        "Represent the query")
    ids, pool = tokenize_for_embedding(tokenizer, "river city", "", max_len=64)  # documents: no instruction
    assert tokenizer.decode(ids[pool == 0].tolist(), skip_special_tokens=False) == "<s><|embed|>\n"
    ids, pool = tokenize_for_embedding(tokenizer, "river city music " * 20, "Represent the query", max_len=16)
    assert len(ids) == 16 and pool.sum() == 16 - (pool == 0).sum() > 0


def test_embedder_unit_norm_and_batch_invariant(model, tokenizer):
    emb = GritEmbedder(model, tokenizer, instruction="Represent the query", max_length=64, batch_size=4)
    texts = ["river city", "alpha beta gamma delta music paper science", "who was the answer", "a", "mountain"]
    vecs = emb.embed(texts)
    assert vecs.shape == (5, emb.dim) == (5, 64) and vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-6)
    # Padding and batch composition do not leak into a text's embedding.
    np.testing.assert_allclose(emb.embed([texts[1]])[0], vecs[1], atol=1e-5)
    # Queries carry the instruction, documents do not: different vectors for the same text.
    assert np.abs(emb.embed(["river city"], instruction="")[0] - vecs[0]).max() > 1e-4
    with pytest.raises(ValueError, match="non-empty"):
        emb.embed(["river", "  "])
    with pytest.raises(ValueError, match="max_len=64"):
        emb.embed(["river"], instruction="alpha " * 80)


def make_batch(rng, b=8, g=2, bg=4, lq=8, lp=12, lg=10):
    def side(n, length, prefix):
        tokens = rand_tokens(rng, n, length)
        lens = rng.integers(prefix + 2, length + 1, n)
        attn = (np.arange(length)[None] < lens[:, None]).astype(np.int32)
        pool = attn.copy()
        pool[:, :prefix] = 0
        return tokens * attn, jnp.asarray(attn), jnp.asarray(pool)

    qt, qa, qp = side(b, lq, 3)
    pt, pa, pp = side(b * g, lp, 2)
    gt, ga, _ = side(bg, lg, 0)
    loss_mask = np.asarray(ga).copy()
    loss_mask[:, :4] = 0
    return {"query_tokens": qt, "query_attention_mask": qa, "query_pool_mask": qp,
            "passage_tokens": pt, "passage_attention_mask": pa, "passage_pool_mask": pp,
            "gen_tokens": gt, "gen_attention_mask": ga, "gen_loss_mask": jnp.asarray(loss_mask)}


def test_unified_loss_fn_is_rep_plus_lambda_gen(model):
    # "mixed" runs in the train-step test; both reductions are checked vs NumPy in test_grit_losses.
    reduction = "token"
    rng = np.random.default_rng(4)
    batch = make_batch(rng)
    cfg = GritConfig(loss_gen_type=reduction, loss_gen_factor=0.5, gen_sub_batch_size=2)
    loss, metrics = jax.jit(GritLoss(cfg))(model, batch, jax.random.key(0))
    q, _ = jencode(model, batch["query_tokens"], batch["query_attention_mask"], batch["query_pool_mask"])
    p, _ = jencode(model, batch["passage_tokens"], batch["passage_attention_mask"], batch["passage_pool_mask"])
    pos = jnp.broadcast_to(jnp.arange(10), batch["gen_tokens"].shape)
    logits = forward(model, batch["gen_tokens"], pos, batch["gen_attention_mask"]).logits
    rep = info_nce(q, p)
    gen, _ = next_token_loss(logits, batch["gen_tokens"], batch["gen_loss_mask"], reduction=reduction,
                             sub_batch_size=2)
    np.testing.assert_allclose(float(metrics["loss_rep"]), float(rep), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["loss_gen"]), float(gen), rtol=1e-5)
    np.testing.assert_allclose(float(loss), float(rep) + 0.5 * float(gen), rtol=1e-5)
    assert float(rep) > 0.1 and float(gen) > 0.1


def test_kl_term_is_distillation_to_the_teachers_hidden_states(model):
    rng = np.random.default_rng(5)
    batch = make_batch(rng)
    pos = jnp.broadcast_to(jnp.arange(10), batch["gen_tokens"].shape)
    out = forward(model, batch["gen_tokens"], pos, batch["gen_attention_mask"])
    teacher_hidden = jnp.asarray(rng.standard_normal(out.hidden.shape), jnp.float32)
    cfg = GritConfig(loss_gen_type="token", loss_gen_factor=0.5, gen_kl_factor=2.0, gen_window=4)
    loss, metrics = jax.jit(GritLoss(cfg))(model, {**batch, "gen_teacher_hidden": teacher_hidden})
    _, plain = jax.jit(GritLoss(GritConfig(loss_gen_type="token", loss_gen_factor=0.5)))(model, batch)
    # float64 NumPy KL over every real generative position, teacher logits = the model's head on its hidden states
    head = np.asarray(model.embedding[...].T if model.config.tie_embeddings else model.lm_head[...], np.float64)
    log_p = np.asarray(teacher_hidden, np.float64) @ head
    log_q = np.asarray(out.logits, np.float64)
    log_p, log_q = (x - np.log(np.exp(x).sum(-1, keepdims=True)) for x in (log_p, log_q))
    mask = np.asarray(batch["gen_attention_mask"])
    ref = ((np.exp(log_p) * (log_p - log_q)).sum(-1) * mask).sum() / mask.sum()
    np.testing.assert_allclose(float(metrics["loss_kl"]), ref, rtol=1e-4)
    np.testing.assert_allclose(float(metrics["loss_gen"]), float(plain["loss_gen"]), rtol=1e-5)
    np.testing.assert_allclose(float(loss), float(plain["loss"]) + 2.0 * ref, rtol=1e-4)
    # the model's own hidden states as the teacher: no KL
    _, same = jax.jit(GritLoss(cfg))(model, {**batch, "gen_teacher_hidden": out.hidden})
    assert abs(float(same["loss_kl"])) < 1e-5
    with pytest.raises(ValueError, match="needs gen_teacher_hidden"):
        GritLoss(cfg)(model, batch)
    with pytest.raises(ValueError, match="gen_kl_factor"):
        GritConfig(mode="embedding", gen_kl_factor=1.0)


def test_train_step_both_passes_and_cross_device_negatives(model):
    """The training helper's jitted train step over one model state runs both passes; with the batch on an
    8-device (data=2, fsdp=4) mesh, the shard_map cross-device InfoNCE gives the same loss and update as
    the plain global computation; the LM head only gets gradient from the generative pass."""
    rng = np.random.default_rng(5)
    batch = make_batch(rng, b=8, g=2, bg=8)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=4, tensor=1))
    tx = optax.sgd(1.0)  # params' = params - grads, so the update is the gradient
    graphdef, state0, shardings = step_lib.init_train_state(ModelConfig.tiny(), tx, mesh, seed=0)

    def run(loss_fn):
        new, metrics = step_lib.make_train_step(graphdef, tx, loss_fn, shardings, mesh)(
            jax.tree.map(jnp.copy, state0), batch)
        return metrics, jax.tree.map(lambda a, b: np.asarray(a - b), state0.params, new.params)

    m_glob, g_glob = run(GritLoss(GritConfig()))
    m_sh, g_sh = run(GritLoss(GritConfig(), mesh=mesh))
    np.testing.assert_allclose(float(m_sh["loss"]), float(m_glob["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m_glob["loss"]), float(m_glob["loss_rep"]) + float(m_glob["loss_gen"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_sh), jax.tree.leaves(g_glob)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5 * np.abs(b).max())
    m_emb, g_emb = run(GritLoss(GritConfig(mode="embedding"), mesh=mesh))
    np.testing.assert_allclose(float(m_emb["loss"]), float(m_glob["loss_rep"]), rtol=1e-5)
    assert np.abs(g_emb["lm_head"][...]).max() == 0.0  # the embedding pass never uses the LM head
    assert np.abs(g_glob["lm_head"][...]).max() > 0.0
    assert np.abs(g_glob["embedding"][...] - g_emb["embedding"][...]).max() > 1e-6
    # Shard-local negatives (no cross-device gathering) give a different loss.
    l_loc, _ = jax.jit(GritLoss(GritConfig(negatives_cross_device=False), mesh=mesh))(model, batch, None)
    assert abs(float(l_loc) - float(m_glob["loss"])) > 1e-3


def test_loss_fn_bad_batches(model):
    rng = np.random.default_rng(6)
    batch = make_batch(rng)
    loss_fn = GritLoss(GritConfig())
    bad = dict(batch, passage_tokens=batch["passage_tokens"][:13], passage_attention_mask=batch[
        "passage_attention_mask"][:13], passage_pool_mask=batch["passage_pool_mask"][:13])
    with pytest.raises(ValueError, match="num_passages=13 must be a positive multiple of num_queries=8"):
        loss_fn(model, bad, None)
    with pytest.raises(ValueError, match="missing keys"):
        loss_fn(model, {k: v for k, v in batch.items() if k != "gen_loss_mask"}, None)
    with pytest.raises(ValueError, match="share one"):
        loss_fn(model, dict(batch, query_pool_mask=batch["query_pool_mask"][:, :5]), None)
    with pytest.raises(ValueError, match="needs the mesh"):
        GritLoss(GritConfig(negatives_cross_device=False))


@pytest.fixture(scope="module")
def cache_setup(model, tokenizer):
    rng = np.random.default_rng(7)
    doc = " ".join(rng.choice(WORDS, 30))
    query = "who was the river city"
    return doc, query


def _full_logits(model, ids):
    tokens = jnp.asarray([ids], jnp.int32)
    return forward(model, tokens, jnp.arange(len(ids))[None], jnp.ones_like(tokens)).logits[0]


def _cached_logits(model, cache, prompt):
    start = int(cache.positions.max()) + 1
    tokens = jnp.asarray([prompt], jnp.int32)
    return forward(model, tokens, start + jnp.arange(len(prompt))[None], jnp.ones_like(tokens),
                   kv_cache=cache).logits[0]


@pytest.mark.parametrize("mode,rag", [("doc", "rag_doc_first"), ("query", "rag_query_first")])
def test_causal_cache_reproduces_plain_rag_exactly(model, tokenizer, cache_setup, mode, rag):
    doc, query = cache_setup
    gc = GritCache(model, tokenizer, cache_attention="causal")
    cache, prompt = gc.build(mode, query, doc)
    none, full = gc.build(rag, query, doc)
    assert none is None and full == list(np.asarray(gc.cached_text_ids(doc if mode == "doc" else query)[0])) + prompt
    np.testing.assert_allclose(np.asarray(_cached_logits(model, cache, prompt)),
                               np.asarray(_full_logits(model, full))[-len(prompt):], atol=2e-5)
    if mode == "doc":  # end to end through generate(..., kv_cache=): identical greedy tokens
        np.testing.assert_array_equal(gc.generate(mode, query, doc, max_new_tokens=6),
                                      gc.generate(rag, query, doc, max_new_tokens=6))


def test_bidirectional_doc_cache_differs_only_by_attention_mode(model, tokenizer, cache_setup):
    doc, query = cache_setup
    store = KVStore(1 << 26)
    gc = GritCache(model, tokenizer, store=store)
    causal = GritCache(model, tokenizer, store=store, fingerprint=gc.fingerprint, cache_attention="causal")
    cache, prompt = gc.build("doc", query, doc)
    assert store.stats["misses"] == 1
    ids, pool = gc.cached_text_ids(doc)
    # The cache is the KV of the bidirectional embedding pass over exactly the doc tokens, positions 0..n-1.
    _, out = jencode(model, jnp.asarray([ids]), jnp.ones((1, len(ids)), jnp.int32), jnp.asarray([pool]))
    np.testing.assert_allclose(np.asarray(cache.k), np.asarray(out.kv.k), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(cache.positions[0]), np.arange(len(ids)))
    ccache, cprompt = causal.build("doc", query, doc)
    assert cprompt == prompt and ccache.length == cache.length
    assert float(jnp.abs(ccache.k - cache.k).max()) > 1e-4  # different attention mode -> different KV...
    # Same tokens, positions and prompt as plain RAG; only the cached pass's attention differs, and so do
    # the logits (the paper's "attention mismatch", §4).
    np.testing.assert_array_equal(np.asarray(ccache.positions), np.asarray(cache.positions))
    _, full = gc.build("rag_doc_first", query, doc)
    plain = np.asarray(_full_logits(model, full))[-len(prompt):]
    assert np.abs(np.asarray(_cached_logits(model, cache, prompt)) - plain).max() > 1e-4
    gc.build("doc", query, doc)
    assert store.stats["hits"] == 1  # second request reuses the stored doc KV


def test_two_segment_caches_positions(model, tokenizer, cache_setup):
    doc, query = cache_setup
    gc = GritCache(model, tokenizer)
    ref = GritCache(model, tokenizer, store=gc.store, fingerprint=gc.fingerprint, reencode_positions=False)
    for mode, (first, second, bos2) in {"query_doc": (query, doc, False), "doc_query": (doc, query, True)}.items():
        cache, _ = gc.build(mode, query, doc)
        n1 = len(gc.cached_text_ids(first)[0])
        n2 = len(gc.cached_text_ids(second, bos=bos2)[0])
        np.testing.assert_array_equal(np.asarray(cache.positions[0]), np.arange(n1 + n2))
        rcache, _ = ref.build(mode, query, doc)
        np.testing.assert_array_equal(np.asarray(rcache.positions[0]),
                                      np.concatenate([np.arange(n1), np.arange(n2)]))
        np.testing.assert_array_equal(np.asarray(rcache.k), np.asarray(cache.k))  # same pre-RoPE keys
    with pytest.raises(ValueError, match="mode='docs'"):
        gc.build("docs", query, doc)
    with pytest.raises(ValueError, match="doc must be a non-empty"):
        gc.build("doc", query, "")
