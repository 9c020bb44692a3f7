"""Low-rank weight deltas (rag_jax.model.delta): the truncation error is the Eckart-Young bound of a float64 NumPy
SVD, an exactly low-rank change is restored (to bfloat16 rounding), and a delta file loads as a model by path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rag_jax.model import ModelConfig, Transformer
from rag_jax.model.delta import apply_delta, delta_metadata, low_rank_delta, relative_error, save_delta
from rag_jax.model.hf import save_hf
from rag_jax.model.load import load_model

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=2, num_kv_heads=1,
                  max_seq_len=32, tie_embeddings=True)


def _tuned(base, rng, true_rank):
    """A copy of ``base`` whose last layer's matrices moved by a rank-``true_rank`` change and whose final norm
    moved; returns (tuned, {path: float64 change})."""
    graphdef, state = nnx.split(base)
    state = jax.tree.map(lambda x: x, state)
    tuned = nnx.merge(graphdef, state)
    changes = {}
    layer = tuned.layers[-1]
    for name, w in (("attn/wq", layer.attn.wq), ("mlp/up", layer.mlp.up)):
        m = w.shape[0]
        d = rng.normal(size=(m, true_rank)) @ rng.normal(size=(true_rank, int(np.prod(w.shape[1:])))) * 0.05
        w[...] = w[...] + jnp.asarray(d.reshape(w.shape), w[...].dtype)
        changes[f"layers/{CFG.num_layers - 1}/{name}"] = d
    tuned.final_norm.scale[...] = tuned.final_norm.scale[...] + 0.1
    return tuned, changes


def test_truncation_error_is_the_eckart_young_bound():
    rng = np.random.default_rng()
    base = Transformer(CFG, rngs=nnx.Rngs(int(rng.integers(1 << 20))))
    tuned, changes = _tuned(base, rng, 8)
    delta = low_rank_delta(base, tuned, rank=3)
    assert set(delta) == set(changes) | {"final_norm/scale"}
    err = relative_error(base, tuned, delta)
    for name, d in changes.items():
        s = np.linalg.svd(d, compute_uv=False)
        np.testing.assert_allclose(err[name], np.sqrt(np.sum(s[3:] ** 2) / np.sum(s ** 2)), rtol=1e-3, atol=1e-5)
        assert delta[name][0].shape == (d.shape[0], 3) and delta[name][1].shape == (3, d.shape[1])
    assert err["final_norm/scale"] == 0.0
    with pytest.raises(ValueError, match="rank=0"):
        low_rank_delta(base, tuned, rank=0)


def test_an_exact_low_rank_change_is_restored_and_loads_by_path(tmp_path):
    rng = np.random.default_rng()
    base = Transformer(CFG, rngs=nnx.Rngs(int(rng.integers(1 << 20))))
    tuned, _ = _tuned(base, rng, 2)
    path = save_delta(tmp_path / "d.safetensors", low_rank_delta(base, tuned, rank=4),
                      {"base": str(save_hf(base, tmp_path / "base")), "block_prefix": "sink"})
    assert delta_metadata(path)["block_prefix"] == "sink"
    tokens = jnp.asarray(rng.integers(0, 64, (2, 12)), jnp.int32)
    pos, seg = jnp.broadcast_to(jnp.arange(12), (2, 12)), jnp.ones((2, 12), jnp.int32)
    want = np.asarray(tuned(tokens, pos, seg).logits)
    before = np.asarray(base(tokens, pos, seg).logits)
    got = np.asarray(apply_delta(base, path)(tokens, pos, seg).logits)
    np.testing.assert_allclose(np.asarray(base(tokens, pos, seg).logits), before)      # base unchanged
    scale = np.abs(want - before).max()
    assert scale > 1e-2 and np.abs(got - want).max() < 0.02 * scale                  # bf16 factors
    loaded = load_model(path)
    assert loaded.block_prefix == "sink" and loaded.source == path
    np.testing.assert_allclose(np.asarray(loaded.model(tokens, pos, seg).logits), got, atol=1e-5)
    save_delta(tmp_path / "nobase.safetensors", {"final_norm/scale": (np.zeros(32, np.float32),)}, {})
    with pytest.raises(ValueError, match="names its base"):
        load_model(tmp_path / "nobase.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x05junk")
    with pytest.raises(ValueError, match="junk.safetensors: not a readable safetensors file"):
        load_model(tmp_path / "junk.safetensors")
