"""LoRA adapters (``ModelConfig.lora_rank``, ``model.lora``): a fresh adapter changes nothing; with trained
adapters the model equals one whose weights are ``W + A B`` set in float64 NumPy; the adapters' gradients are
the chain rule of the weight gradient; a train step over ``LORA_TRAINABLE`` moves only the adapters; deltas and
HF export fold them exactly."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rag_jax import sharding
from rag_jax.model import ModelConfig, Transformer
from rag_jax.model.config import LORA_TARGETS
from rag_jax.model.delta import apply_delta, low_rank_delta, save_delta
from rag_jax.model.hf import load_hf, save_hf
from rag_jax.model.lora import LORA_TRAINABLE, add_lora, merge_lora
from rag_jax.model.transformer import to_scanned
from rag_jax.train import checkpoint, optim, step as step_lib
from rag_jax.train.objectives import LMLoss

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_seq_len=64)
PARTS = {"wq": "attn", "wk": "attn", "wv": "attn", "wo": "attn", "gate": "mlp", "up": "mlp", "down": "mlp"}


def _inputs(rng, b=2, s=12):
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, s)), jnp.int32)
    return tokens, jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)), jnp.ones((b, s), jnp.int32)


def _randomize_adapters(model, rng, scale=0.2):
    """Every ``lora_b`` (zero at init) and ``lora_a`` set to fresh normals; returns the values by path."""
    state = nnx.state(model, nnx.LoRAParam)
    state = jax.tree.map(lambda x: jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype), state)
    nnx.update(model, state)
    return {"/".join(map(str, p)): np.asarray(v.get_value(), np.float64) for p, v in nnx.to_flat_state(state)}


def _reference(base, adapters, targets=LORA_TARGETS):
    """A plain copy of ``base`` whose weights are ``W + A B`` computed in float64 NumPy."""
    ref = nnx.clone(base)
    for i in range(CFG.num_layers):
        for name in targets:
            module = getattr(ref.layers[i], PARTS[name])
            w = np.asarray(getattr(module, name)[...], np.float64)
            a = adapters[f"layers/{i}/{PARTS[name]}/lora_{name}/lora_a"]
            b = adapters[f"layers/{i}/{PARTS[name]}/lora_{name}/lora_b"]
            getattr(module, name).set_value(jnp.asarray(w + (a @ b).reshape(w.shape), jnp.float32))
    return ref


@pytest.mark.parametrize("scan", [False, True])
def test_adapters_start_as_the_base_and_equal_the_merged_weights(scan):
    rng = np.random.default_rng()
    base = Transformer(CFG, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    x = _inputs(rng)
    want = base(*x).logits
    start = to_scanned(base) if scan else base
    lora = add_lora(start, 4, seed=int(rng.integers(1 << 30)))
    assert lora.config.lora_rank == 4 and lora.config.scan_layers == scan
    np.testing.assert_array_equal(lora(*x).logits, start(*x).logits)    # B = 0: exactly the base
    lora = add_lora(base, 4, seed=int(rng.integers(1 << 30)))
    adapters = _randomize_adapters(lora, rng)
    assert len(adapters) == 2 * 7 * CFG.num_layers
    ref = _reference(base, adapters)(*x).logits
    assert np.abs(np.asarray(ref) - np.asarray(want)).max() > 0.1         # the adapters matter
    np.testing.assert_allclose(lora(*x).logits, ref, rtol=0, atol=2e-5)
    np.testing.assert_allclose(to_scanned(lora)(*x).logits, ref, rtol=0, atol=2e-5)
    merged = merge_lora(to_scanned(lora) if scan else lora)
    assert merged.config.lora_rank == 0 and not nnx.state(merged, nnx.LoRAParam)
    np.testing.assert_allclose(merged(*x).logits, ref, rtol=0, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(base(*x).logits), np.asarray(want))   # base untouched


def test_targets_subset_and_bad_settings():
    rng = np.random.default_rng()
    base = Transformer(CFG, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    lora = add_lora(base, 3, targets=("wv", "down"))
    adapters = _randomize_adapters(lora, rng)
    assert {k.split("/")[3] for k in adapters} == {"lora_wv", "lora_down"}
    x = _inputs(rng)
    np.testing.assert_allclose(lora(*x).logits, _reference(base, adapters, ("wv", "down"))(*x).logits,
                               rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="lora_rank=-1"):
        CFG.replace(lora_rank=-1)
    with pytest.raises(ValueError, match=r"lora_targets=\['wq', 'q_proj'\]"):
        CFG.replace(lora_rank=2, lora_targets=("wq", "q_proj"))
    with pytest.raises(ValueError, match="rank=0 must be an integer >= 1"):
        add_lora(base, 0)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        add_lora(lora, 2)
    # without adapters a config's identity is what it was before adapters existed (old runs resume)
    assert "lora" not in CFG.fingerprint() and "lora_rank" in CFG.replace(lora_rank=2).fingerprint()
    assert "lora" not in repr(CFG) and "lora_rank=2" in repr(CFG.replace(lora_rank=2))   # model_fingerprint keys
    fp = checkpoint.run_fingerprint(type("R", (), {"model": CFG, "data": {}, "train": type(
        "T", (), {"seed": 0, "objective": "lm"})})())
    assert not any(k.startswith("lora") for k in fp["model"])


def test_adapter_gradients_are_the_chain_rule_of_the_weight_gradient():
    """d loss / dA = dW B^T and d loss / dB = A^T dW, with dW the gradient of the merged model at W + A B."""
    rng = np.random.default_rng()
    base = Transformer(CFG, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    lora = add_lora(base, 4, seed=int(rng.integers(1 << 30)))
    adapters = _randomize_adapters(lora, rng)
    x = _inputs(rng)
    target = jnp.asarray(rng.standard_normal((2, 12, CFG.vocab_size)), jnp.float32)

    def loss(model):
        return jnp.sum(model(*x).logits * target)

    g_lora = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(lora)
    g_lora = {"/".join(map(str, p)): np.asarray(v.get_value(), np.float64) for p, v in nnx.to_flat_state(g_lora)}
    g_w = nnx.grad(loss)(_reference(base, adapters))
    for i in range(CFG.num_layers):
        for name, part in PARTS.items():
            key = f"layers/{i}/{part}/lora_{name}"
            a, b = adapters[key + "/lora_a"], adapters[key + "/lora_b"]
            dw = np.asarray(getattr(getattr(g_w.layers[i], part), name).get_value(), np.float64)
            dw = dw.reshape(a.shape[0], b.shape[1])
            np.testing.assert_allclose(g_lora[key + "/lora_a"], dw @ b.T, rtol=2e-4, atol=2e-4 * np.abs(dw).max())
            np.testing.assert_allclose(g_lora[key + "/lora_b"], a.T @ dw, rtol=2e-4, atol=2e-4 * np.abs(dw).max())


def _train(lora, mesh_cfg, devices, tokens, seed, steps=5):
    """``steps`` AdamW steps over the adapters (``LORA_TRAINABLE``) on a mesh -> (params before, after, losses,
    the trainable mask by path). Adam's eps 1e-4 keeps the update Lipschitz in the gradient (layouts compare)."""
    opt_cfg = optim.OptimizerConfig(learning_rate=1e-2, warmup_steps=0, weight_decay=0.0, eps=1e-4,
                                    trainable=LORA_TRAINABLE)
    params = nnx.state(lora, nnx.Param)
    mask = {optim.param_path(p): m for p, m in jax.tree_util.tree_flatten_with_path(
        optim.trainable_mask(opt_cfg, params))[0]}
    tx = optim.make_optimizer(opt_cfg, 10)
    mesh = sharding.make_mesh(mesh_cfg, devices=devices)
    graphdef, state, shardings = step_lib.init_train_state(lora.config, tx, mesh, seed=seed, params=params)
    b, s = tokens.shape
    batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.ones((b, s), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))}
    train_step = step_lib.make_train_step(graphdef, tx, LMLoss(mode="causal"), shardings, mesh,
                                          trainable=optim.trainable_mask(opt_cfg, state.params))
    leaves = lambda st: {optim.param_path(p): np.asarray(v) for p, v in  # noqa: E731
                         jax.tree_util.tree_flatten_with_path(jax.device_get(st.params))[0]}
    before, losses = leaves(state), []
    for _ in range(steps):
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return before, leaves(state), losses, mask


def test_a_train_step_over_the_adapters_moves_only_them_on_any_mesh():
    """Adapters move, every other parameter stays bit-equal, the loss falls; on a data x fsdp x tensor mesh of 8
    (fake CPU) devices the adapters end where the one-device run puts them."""
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 30))
    lora = add_lora(Transformer(CFG, rngs=nnx.Rngs(seed)), 4, seed=seed)
    tokens = rng.integers(0, CFG.vocab_size, (8, 16)).astype(np.int32)     # two rows per batch shard below
    one = sharding.MeshConfig(data=1, fsdp=1, tensor=1)
    before, after, losses, mask = _train(lora, one, jax.devices()[:1], tokens, seed)
    assert {k for k, m in mask.items() if m} == {k for k in mask if "/lora_" in k} and len(mask) > 2 * 7 * 2
    for k in before:
        assert np.array_equal(before[k], after[k]) != mask[k], k      # adapters moved, everything else bit-equal
    assert losses[-1] < losses[0]
    _, sharded, sharded_losses, _ = _train(lora, sharding.MeshConfig(data=2, fsdp=2, tensor=2), jax.devices()[:8],
                                           tokens, seed)
    np.testing.assert_allclose(sharded_losses, losses, rtol=1e-5)
    for k in after:
        np.testing.assert_allclose(sharded[k], after[k], rtol=0, atol=1e-4, err_msg=k)


def test_delta_and_hf_export_fold_the_adapters(tmp_path):
    rng = np.random.default_rng()
    base = Transformer(CFG, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    lora = add_lora(base, 3, seed=int(rng.integers(1 << 30)))
    adapters = _randomize_adapters(lora, rng)
    x = _inputs(rng)
    want = _reference(base, adapters)(*x).logits
    delta = low_rank_delta(base, lora, rank=3)                # each W + A B - W has rank 3: exact at rank 3
    assert len(delta) == 7 * CFG.num_layers
    path = save_delta(tmp_path / "delta.safetensors", delta, {"base": "test"})
    np.testing.assert_allclose(apply_delta(base, path)(*x).logits, want, rtol=0, atol=0.05)   # bf16 factors
    save_hf(lora, tmp_path / "hf")
    np.testing.assert_allclose(load_hf(tmp_path / "hf")[1](*x).logits, want, rtol=0, atol=2e-5)
