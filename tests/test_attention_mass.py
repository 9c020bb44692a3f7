"""``evaluation.attention_mass``: layer 0 against a float64 NumPy transcription (embedding, RMSNorm, q/k projections,
RoPE, masked softmax), every layer's input against the model's own forward in the same mode, rows that sum to 1, and
block mode's first-layer equality with full attention (the last block's layer-0 keys and queries do not depend on
the mode)."""
import numpy as np
import pytest
from flax import nnx

from rag_jax.evaluation import attention_mass
from rag_jax.model import ModelConfig, Transformer

CFG = ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=64, num_layers=3, num_heads=6, num_kv_heads=2,
                  max_seq_len=256)


def _ref_layer0(model, blocks, mode, lead=None):
    """float64 NumPy: the last block's softmax weights at layer 0, summed per block, mean over queries and heads."""
    tokens, positions, seg, is_global = (x[0] for x in attention_mass.block_layout(blocks))
    emb = np.asarray(model.embedding[...], np.float64)[tokens]
    layer = model.layers[0]
    x = emb / np.sqrt((emb ** 2).mean(-1, keepdims=True) + CFG.rms_norm_eps) * np.asarray(layer.input_norm.scale[...])
    q = np.einsum("sh,hnd->snd", x, np.asarray(layer.attn.wq[...], np.float64))
    k = np.einsum("sh,hnd->snd", x, np.asarray(layer.attn.wk[...], np.float64))
    d = CFG.head_dim
    inv = 1.0 / CFG.rope_theta ** (np.arange(0, d, 2) / d)
    ang = np.concatenate([positions[:, None] * inv] * 2, -1)[:, None, :]

    def rot(t):
        return t * np.cos(ang) + np.concatenate([-t[..., d // 2:], t[..., :d // 2]], -1) * np.sin(ang)
    q, k = rot(q), np.repeat(rot(k), CFG.num_heads // CFG.num_kv_heads, axis=1)
    logits = np.einsum("qnd,knd->nqk", q, k) / np.sqrt(d)
    allowed = positions[None, :] <= positions[:, None]
    if mode == "block":
        allowed &= (seg[:, None] == seg[None, :]) | is_global[:, None]
    p = np.where(allowed, np.exp(logits - np.where(allowed, logits, -np.inf).max(-1, keepdims=True)), 0.0)
    p /= p.sum(-1, keepdims=True)
    last = seg == len(blocks)
    per_key = p[:, last].mean((0, 1))
    offset = np.concatenate([np.arange(len(b)) for b in blocks])
    counted = offset < (lead or len(offset))
    return np.array([per_key[(seg == i + 1) & counted].sum() for i in range(len(blocks))])


@pytest.mark.parametrize("mode", attention_mass.MODES)
def test_layer0_matches_numpy_and_layer_inputs_match_the_model(mode):
    import jax.numpy as jnp
    rng = np.random.default_rng()
    model = Transformer(CFG, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    blocks = [rng.integers(0, CFG.vocab_size, int(n)).tolist() for n in rng.integers(3, 12, 5)]
    masses = attention_mass.block_attention_mass(model, blocks, mode)
    assert masses.shape == (CFG.num_layers, len(blocks))
    np.testing.assert_allclose(masses.sum(1), 1.0, atol=1e-5)
    np.testing.assert_allclose(masses[0], _ref_layer0(model, blocks, mode), atol=2e-5)
    lead = int(rng.integers(1, 3))                   # each block's first tokens only
    first = attention_mass.block_attention_mass(model, blocks, mode, lead=lead)
    np.testing.assert_allclose(first[0], _ref_layer0(model, blocks, mode, lead), atol=2e-5)
    assert (first <= masses + 1e-6).all() and (first < masses - 1e-4).any()
    tokens, positions, seg, is_global = (jnp.asarray(x) for x in attention_mass.block_layout(blocks))
    graphdef, state = nnx.split(model)
    _, residual = attention_mass._masses(graphdef, state, tokens, positions, seg, is_global, mode, len(blocks),
                                         tokens.shape[1])
    want, _ = model.encode(tokens, positions, seg, mode="causal" if mode == "full" else "block",
                           is_global=None if mode == "full" else is_global)
    np.testing.assert_allclose(residual, want, atol=1e-5)


def test_block_mode_differs_above_layer0_only():
    rng = np.random.default_rng()
    model = Transformer(CFG, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    for layer in model.layers:                       # sharp attention: the modes differ clearly above layer 0
        for w in (layer.attn.wq, layer.attn.wk, layer.attn.wv, layer.attn.wo):
            w[...] = w[...] * 6
    blocks = [rng.integers(0, CFG.vocab_size, 8).tolist() for _ in range(4)]
    full, block = (attention_mass.block_attention_mass(model, blocks, m) for m in attention_mass.MODES)
    np.testing.assert_allclose(full[0], block[0], atol=1e-6)
    assert np.abs(full[1:] - block[1:]).max() > 1e-3


def test_bad_inputs_are_refused_by_name():
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="mode='sideways'"):
        attention_mass.block_attention_mass(model, [[1], [2]], "sideways")
    with pytest.raises(ValueError, match="lead=0 must be at least 1"):
        attention_mass.block_attention_mass(model, [[1], [2]], "full", lead=0)
    with pytest.raises(ValueError, match="at least 2 non-empty"):
        attention_mass.block_attention_mass(model, [[1, 2]], "full")
