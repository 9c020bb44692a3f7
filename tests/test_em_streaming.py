"""EM-LLM streaming: plumbing check vs full attention, InfLLM positions vs a float64 NumPy forward, the joint
softmax, flat device memory, and bad input (issue 7 "Must show")."""
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rag_jax.memory import EMLLM, EMLLMConfig
from rag_jax.model import ModelConfig, Transformer, attend, attend_joint, key_mass, rope_inv_freq

CONFIG_DIR = Path(__file__).resolve().parents[1] / "train" / "configs"


@pytest.fixture(scope="module")
def model():
    return Transformer(ModelConfig.tiny(num_layers=2), rngs=nnx.Rngs(0))


def full_logits(model, tokens):
    t = len(tokens)
    out = model(jnp.asarray(tokens)[None], jnp.arange(t)[None], jnp.ones((1, t), jnp.int32))
    return np.asarray(out.logits[0])


def _rope64(x, positions, inv_freq):
    """float64 RoPE (HF rotate_half layout): x ``[s, h, d]``, positions ``[s]``."""
    ang = positions[:, None].astype(np.float64) * inv_freq.astype(np.float64)[None]
    ang = np.concatenate([ang, ang], -1)[:, None, :]
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * np.cos(ang) + rot * np.sin(ang)


def test_joint_softmax_equals_softmax_over_concatenated_keys():
    rng = np.random.default_rng(0)
    b, q_len, heads, kv_heads, d = 1, 5, 4, 2, 8
    q1, q2 = (rng.normal(size=(b, q_len, heads, d)).astype(np.float32) for _ in range(2))
    k1, v1 = (rng.normal(size=(b, 7, kv_heads, d)).astype(np.float32) for _ in range(2))
    k2, v2 = (rng.normal(size=(b, 9, kv_heads, d)).astype(np.float32) for _ in range(2))
    m1 = rng.random((b, q_len, 7)) < 0.7
    m2 = rng.random((b, q_len, 9)) < 0.7
    m1[..., 0] = True
    q_ok = np.array([1, 1, 1, 1, 0], bool)
    groups = [tuple(map(jnp.asarray, g)) for g in ((q1, k1, v1, m1), (q2, k2, v2, m2))]
    out, lse = attend_joint(groups, return_lse=True)
    mass = key_mass(*groups[0][:2], groups[0][3], lse, jnp.asarray(q_ok, jnp.float32)[None, None])[0, 0]
    one_hot = jnp.asarray(np.arange(q_len) == 3, jnp.float32)[None, None]
    last = jnp.concatenate([key_mass(gq, gk, gm, lse, one_hot)[0, 0] for gq, gk, _, gm in groups], -1)

    # float64 reference: per query head, logits of both groups (own query each) in one softmax.
    g = heads // kv_heads
    want = np.zeros((b, q_len, heads, d))
    want_mass = np.zeros((heads, 7))
    want_last = np.zeros((heads, 16))
    for h in range(heads):
        kh = h // g
        l1 = q1[0, :, h].astype(np.float64) @ k1[0, :, kh].T.astype(np.float64) / np.sqrt(d)
        l2 = q2[0, :, h].astype(np.float64) @ k2[0, :, kh].T.astype(np.float64) / np.sqrt(d)
        logits = np.concatenate([np.where(m1[0], l1, -np.inf), np.where(m2[0], l2, -np.inf)], 1)
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        want[0, :, h] = p @ np.concatenate([v1[0, :, kh], v2[0, :, kh]]).astype(np.float64)
        want_mass[h] = (p[:, :7] * q_ok[:, None]).sum(0)
        want_last[h] = p[3]                       # the last valid query (diagnostics)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(mass), want_mass, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(last), want_last, rtol=1e-5, atol=1e-5)

    # Same query in both groups: identical to one attention over the concatenated keys.
    same = attend_joint([(groups[0][0], groups[0][1], groups[0][2], groups[0][3]),
                         (groups[0][0], groups[1][1], groups[1][2], groups[1][3])])
    concat = attend(groups[0][0], jnp.concatenate([groups[0][1], groups[1][1]], 1),
                    jnp.concatenate([groups[0][2], groups[1][2]], 1), jnp.concatenate([groups[0][3], groups[1][3]], 2))
    np.testing.assert_allclose(np.asarray(same), np.asarray(concat), rtol=1e-6, atol=1e-6)


def test_plumbing_memory_holds_everything_equals_full_attention(model):
    """Contiguous positions, a 64-token window and a memory budget holding every event (with refinement and
    contiguity on): prefill and decode logits equal full causal attention."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, model.config.vocab_size, 300).astype(np.int32)
    cfg = EMLLMConfig(n_init=8, n_local=64, n_mem=2048, chunk_size=32, min_block_size=4, max_block_size=16,
                      positions="contiguous", refinement="modularity", refine_from_layer=1, contiguity=True)
    em = EMLLM(model, cfg)
    got = em.prefill(tokens, return_all_logits=True)
    assert len(em.store) > 10 and em.segmenter.init_len == 8          # memory really in use
    assert em.store.num_tokens + em.segmenter.init_len + em.segmenter.fill == len(tokens)
    generated = [int(np.argmax(got[-1]))]
    steps = []
    for _ in range(3):
        steps.append(em.step(generated[-1]))
        generated.append(int(np.argmax(steps[-1])))
    want = full_logits(model, np.concatenate([tokens, generated[:-1]]))    # causal: prefixes are the same
    np.testing.assert_allclose(got, want[:len(tokens)], rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.stack(steps), want[len(tokens):], rtol=0, atol=1e-5)


@pytest.mark.parametrize("positions", ["inf_llm", "contiguous"])
def test_blockwise_attention_path_equals_dense(positions):
    """EM-LLM on the blockwise kernel (``attention_impl="blockwise"``) equals the dense path: logits, the
    representative-token scores every layer accumulates, and the diagnostic weights of the last query."""
    tokens = np.random.default_rng(7).integers(0, 256, 260).astype(np.int32)
    cfg = EMLLMConfig(n_init=8, n_local=64, n_mem=64, chunk_size=32, min_block_size=4, max_block_size=16,
                      positions=positions)
    runs = {}
    for impl in ("dense", "blockwise"):
        em = EMLLM(Transformer(ModelConfig.tiny(num_layers=2, attention_impl=impl), rngs=nnx.Rngs(5)), cfg,
                   diagnose=True)
        runs[impl] = (em.prefill(tokens, return_all_logits=True), em)
    (dense, em_d), (block, em_b) = runs["dense"], runs["blockwise"]
    assert len(em_b.store) > 5 and em_b.retrieved[1]                   # memory in use
    np.testing.assert_allclose(block, dense, rtol=0, atol=1e-5)
    for bd, bb in zip(em_d.buffers, em_b.buffers):
        np.testing.assert_allclose(np.asarray(bb.recent_score), np.asarray(bd.recent_score), rtol=1e-5, atol=1e-5)
    for (pos_d, w_d), (pos_b, w_b) in zip(em_d.attention, em_b.attention):
        np.testing.assert_array_equal(pos_b, pos_d)
        np.testing.assert_allclose(w_b, w_d, rtol=0, atol=1e-6)
        np.testing.assert_allclose(w_b.sum(-1), 1.0, atol=1e-5)


def test_window_covering_input_equals_full_attention(model):
    tokens = np.random.default_rng(2).integers(0, model.config.vocab_size, 150).astype(np.int32)
    em = EMLLM(model, EMLLMConfig(n_init=8, n_local=160, n_mem=48, chunk_size=32, min_block_size=4,
                                  max_block_size=16))
    got = em.prefill(tokens, return_all_logits=True)
    assert len(em.store) == 0
    np.testing.assert_allclose(got, full_logits(model, tokens), rtol=0, atol=1e-5)


def test_memory_off_equals_sliding_window_model(model):
    tokens = np.random.default_rng(3).integers(0, model.config.vocab_size, 200).astype(np.int32)
    cfg = EMLLMConfig(n_init=8, n_local=64, n_mem=48, chunk_size=32, min_block_size=4, max_block_size=16,
                      memory=False)
    got = EMLLM(model, cfg).prefill(tokens, return_all_logits=True)
    windowed = Transformer(model.config.replace(sliding_window=64), rngs=nnx.Rngs(0))
    np.testing.assert_allclose(got, full_logits(windowed, tokens), rtol=0, atol=1e-5)


def numpy_inf_llm_forward(model, tokens, n_local):
    """float64 forward of a 1-layer model where every key at distance >= n_local is attended in the InfLLM
    memory frame (key unrotated, query rotated to n_local - 1) and nearer keys at true relative positions,
    all in one softmax per query (everything retrieved)."""
    cfg = model.config
    p = lambda x: np.asarray(x[...], np.float64)  # noqa: E731
    layer = model.layers[0]
    inv = np.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), np.float64)

    def rms(x, scale):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * p(scale)

    t = len(tokens)
    x = p(model.embedding)[tokens]
    h = rms(x, layer.input_norm.scale)
    q = np.einsum("sh,hnd->snd", h, p(layer.attn.wq))
    k = np.einsum("sh,hnd->snd", h, p(layer.attn.wk))
    v = np.einsum("sh,hnd->snd", h, p(layer.attn.wv))
    pos = np.arange(t)
    q_loc, k_loc = _rope64(q, pos, inv), _rope64(k, pos, inv)
    q_mem = _rope64(q, np.full(t, n_local - 1), inv)
    g = cfg.num_heads // cfg.num_kv_heads
    out = np.zeros_like(q)
    dist = pos[:, None] - pos[None, :]
    for hd in range(cfg.num_heads):
        kh = hd // g
        local = q_loc[:, hd] @ k_loc[:, kh].T
        memory = q_mem[:, hd] @ k[:, kh].T
        logits = np.where(dist < n_local, local, memory) / np.sqrt(cfg.head_dim)
        logits = np.where(dist >= 0, logits, -np.inf)
        w = np.exp(logits - logits.max(1, keepdims=True))
        out[:, hd] = (w / w.sum(1, keepdims=True)) @ v[:, kh]
    x = x + np.einsum("snd,ndh->sh", out, p(layer.attn.wo))
    h = rms(x, layer.post_attn_norm.scale)
    gate = h @ p(layer.mlp.gate)
    x = x + ((gate / (1 + np.exp(-gate))) * (h @ p(layer.mlp.up))) @ p(layer.mlp.down)
    return rms(x, model.final_norm.scale) @ p(model.lm_head)


def test_inf_llm_positions_equal_float64_reference():
    model1 = Transformer(ModelConfig.tiny(num_layers=1), rngs=nnx.Rngs(1))
    tokens = np.random.default_rng(4).integers(0, model1.config.vocab_size, 200).astype(np.int32)
    cfg = EMLLMConfig(n_init=8, n_local=64, n_mem=2048, chunk_size=32, min_block_size=4, max_block_size=16)
    em = EMLLM(model1, cfg)
    got = em.prefill(tokens, return_all_logits=True)
    assert len(em.store) > 5
    want = numpy_inf_llm_forward(model1, tokens, 64)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    # And it is not full attention (positions beyond the window really are collapsed).
    assert np.abs(got - full_logits(model1, tokens)).max() > 1e-3


def test_device_memory_flat_as_stream_grows(model):
    cfg = EMLLMConfig(n_init=8, n_local=64, n_mem=48, chunk_size=32, min_block_size=4, max_block_size=16,
                      contiguity=True, refinement="conductance", refine_from_layer=0)
    em = EMLLM(model, cfg)
    rng = np.random.default_rng(5)
    em.prefill(rng.integers(0, model.config.vocab_size, 256))
    shapes = {name: (x.shape, x.dtype) for name, x in em.device_buffers().items()}
    device_bytes, host_bytes, events = em.device_nbytes, em.store.nbytes, len(em.store)
    for _ in range(3):
        em.prefill(rng.integers(0, model.config.vocab_size, 384))
        for _ in range(5):
            em.step(int(rng.integers(0, model.config.vocab_size)))
        assert {name: (x.shape, x.dtype) for name, x in em.device_buffers().items()} == shapes
        assert em.device_nbytes == device_bytes
    assert len(em.store) > 3 * events and em.store.nbytes > 3 * host_bytes      # host memory grows instead
    assert em.segmenter.stream_len == 256 + 3 * (384 + 5)
    sizes = np.asarray(em.store.sizes)
    for layer, ids in enumerate(em.retrieved):
        assert ids == sorted(ids) and len(set(ids)) == len(ids)                 # temporal order
        assert 0 < sizes[ids].sum() <= cfg.memory_capacity < em.store.num_tokens
    assert em.cache.loads > 0


def test_uniform_segmentation_gives_fixed_blocks(model):
    cfg = EMLLMConfig(n_init=16, n_local=64, n_mem=48, chunk_size=32, min_block_size=4, max_block_size=16,
                      segmentation="uniform")
    em = EMLLM(model, cfg)
    em.prefill(np.random.default_rng(6).integers(0, model.config.vocab_size, 400))
    assert len(em.store) > 10
    assert set(em.store.sizes) == {16} and all(s % 16 == 0 for s in em.store.starts)


def test_generate_and_bad_input(model):
    em = EMLLM(model, EMLLMConfig(n_init=8, n_local=64, n_mem=48, chunk_size=32, min_block_size=4,
                                  max_block_size=16))
    out = em.generate(np.arange(40) % 100, max_new_tokens=4)
    assert len(out) == 4 and all(0 <= t < model.config.vocab_size for t in out)
    with pytest.raises(ValueError, match="empty"):
        em.prefill([])
    with pytest.raises(ValueError, match="batch size 1"):
        em.prefill(np.zeros((2, 5), np.int32))
    with pytest.raises(ValueError, match="vocab_size"):
        em.prefill([1, 2, 10_000])
    with pytest.raises(TypeError, match="integers"):
        em.prefill([0.5, 1.5])
    with pytest.raises(ValueError, match="refine_from_layer"):
        EMLLM(model, EMLLMConfig(refinement="modularity", refine_from_layer=2))


def test_shipped_configs_load():
    paths = sorted(CONFIG_DIR.glob("em_llm_*.yaml"))
    assert len(paths) >= 5
    for path in paths:
        cfg = EMLLMConfig.from_yaml(path)
        assert cfg.n_mem >= cfg.max_block_size and cfg.chunk_size <= cfg.n_local


def test_verify_commit_reads_like_steps_and_forgets_the_rejected_tokens(model):
    """Speculative decoding's target interface (``verify`` a round, ``commit`` a prefix), in the setting where
    EM-LLM equals full attention (contiguous positions, a memory holding every event): verified logits are full
    attention's after each token; after ``commit(m)`` the stream continues as one that never read the rest,
    through further rounds and steps that form events; the rejected slots' scores are cleared; misuse raises."""
    rng = np.random.default_rng()
    vocab = model.config.vocab_size
    prompt = rng.integers(0, vocab, int(rng.integers(150, 260))).astype(np.int32)
    cfg = EMLLMConfig(n_init=8, n_local=64, n_mem=2048, chunk_size=32, min_block_size=4, max_block_size=16,
                      positions="contiguous", contiguity=True)
    em = EMLLM(model, cfg)
    em.prefill(prompt)
    kept = list(prompt)
    with pytest.raises(ValueError, match="needs a verify"):
        em.commit(0)
    events_before = len(em.store)
    for round_ in range(8):
        drafts = rng.integers(0, vocab, int(rng.integers(1, 7))).tolist()
        rows = em.verify(drafts)
        want = full_logits(model, np.asarray(kept + drafts, np.int32))
        np.testing.assert_allclose(rows, want[len(kept):], rtol=0, atol=1e-5)
        if round_ == 0:
            with pytest.raises(ValueError, match="await commit"):
                em.step(1)
            with pytest.raises(ValueError, match="must be in"):
                em.commit(len(drafts) + 1)
        m = int(rng.integers(0, len(drafts) + 1))
        em.commit(m)
        kept += drafts[:m]
        fill = em.segmenter.fill
        assert all(float(np.abs(np.asarray(b.recent_score)[:, fill:]).max()) == 0.0 for b in em.buffers)
        x = int(rng.integers(vocab))
        np.testing.assert_allclose(em.step(x), full_logits(model, np.asarray(kept + [x], np.int32))[-1],
                                   rtol=0, atol=1e-5)
        kept.append(x)
    assert em.segmenter.stream_len == len(kept) and len(em.store) > events_before    # memory formed meanwhile
    assert em.store.num_tokens + em.segmenter.init_len + em.segmenter.fill == len(kept)
    with pytest.raises(ValueError, match="at most chunk_size=32"):
        em.verify(np.zeros(33, np.int32))


def test_sampled_decode_attention_over_the_memory(model):
    """MagicPIG / TopK as EM-LLM's decode attention (``decode_attention``), where EM-LLM equals full attention:
    TopK with a budget over the whole memory, and MagicPIG on dense layers only, give full attention's decode
    logits; MagicPIG sampling on every layer changes every decode step's logits (the estimate is in use; prefill's
    last token is one) and leaves prefill chunks exact."""
    from rag_jax.inference.magicpig import MagicPIGDecode, TopKDecode
    rng = np.random.default_rng()
    tokens = rng.integers(0, model.config.vocab_size, int(rng.integers(150, 220))).astype(np.int32)
    cfg = EMLLMConfig(n_init=8, n_local=64, n_mem=2048, chunk_size=32, min_block_size=4, max_block_size=16,
                      positions="contiguous")
    extra = rng.integers(0, model.config.vocab_size, 3).tolist()
    want = full_logits(model, np.concatenate([tokens, extra]))[len(tokens) - 1:]

    def run(policy):
        em = EMLLM(model, cfg, decode_attention=policy)
        return np.stack([em.prefill(tokens)] + [em.step(t) for t in extra])

    seed = int(rng.integers(1000))
    for policy in (TopKDecode(budget=4096), MagicPIGDecode(bits=4, tables=8, seed=seed, dense_layers=(0, 1))):
        np.testing.assert_allclose(run(policy), want, rtol=0, atol=1e-5)
    em = EMLLM(model, cfg, decode_attention=MagicPIGDecode(bits=4, tables=8, seed=seed))
    chunks = em.prefill(tokens, return_all_logits=True)    # chunks exact; the last token is a decode step
    np.testing.assert_allclose(chunks[:-1], full_logits(model, tokens)[:-1], rtol=0, atol=1e-5)
    sampled = np.stack([chunks[-1]] + [em.step(t) for t in extra])
    assert np.isfinite(sampled).all() and (np.abs(sampled - want).max(1) > 1e-3).all()
    error, used, count = np.asarray(em.estimates).T
    assert (error == 0).all() and (0 < used).all() and (used < 1).all() and (count > 50).all()
    # measured: exact attention beside the estimate at the same inputs; the stream goes on with the estimate
    measured = EMLLM(model, cfg, decode_attention=MagicPIGDecode(bits=4, tables=8, seed=seed), measure=True)
    np.testing.assert_allclose(np.stack([measured.prefill(tokens)] + [measured.step(t) for t in extra]), sampled,
                               rtol=0, atol=1e-5)
    error, used, count = np.asarray(measured.estimates).T
    assert (error > 1e-3).all() and np.isfinite(error).all() and (0 < used).all() and (used < 1).all()
    full = EMLLM(model, cfg, decode_attention=TopKDecode(budget=4096), measure=True)
    full.prefill(tokens)
    error, used, _ = np.asarray(full.estimates).T
    assert (error < 1e-5).all() and (used == 1).all()
    with pytest.raises(ValueError, match="decode_attention="):
        EMLLM(model, cfg, decode_attention="magicpig")
    with pytest.raises(ValueError, match="memory=False"):
        EMLLM(model, cfg.replace(memory=False), decode_attention=TopKDecode())
