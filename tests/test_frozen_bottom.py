"""Training a top from a frozen bottom's cached output (rag_jax.train.frozen_bottom): the bottom's residual stream
vs HF transformers' hidden states, the split forward and the GRIT loss (values and gradients) vs the full model,
the feature table (padding, save/load), merge_top, and a partial-training run that leaves the embedding frozen."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rag_jax.model import ModelConfig, Transformer
from rag_jax.train.frozen_bottom import TOP_TRAINABLE, FrozenBottom, merge_top, split_model
from rag_jax.train.objectives.grit import GritConfig, GritLoss

CFG = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2,
                  max_seq_len=256)


@pytest.fixture(scope="module")
def model():
    m = Transformer(CFG, rngs=nnx.Rngs(3))
    for i, norm in enumerate([m.final_norm] + [layer.input_norm for layer in m.layers]):  # random norm scales
        norm.scale[...] = 1.0 + 0.3 * jax.random.normal(jax.random.key(i), norm.scale.shape)
    return m


def _pos(shape):
    return jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape)


def test_residual_matches_hf_hidden_states(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from rag_jax.model.hf import load_hf

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)).eval()
    hf.save_pretrained(tmp_path)
    _, ours, _ = load_hf(tmp_path)
    ids = np.random.default_rng(1).integers(0, 97, (2, 20))
    with torch.no_grad():
        ref = hf(torch.tensor(ids), output_hidden_states=True).hidden_states
    for top_layers in (1, 3):
        bottom, _ = split_model(ours, top_layers)
        got = bottom.residual(jnp.asarray(ids), _pos(ids.shape), jnp.ones(ids.shape, jnp.int32))
        np.testing.assert_allclose(np.asarray(got), ref[4 - top_layers].numpy(), atol=2e-5)  # input of that layer


@pytest.mark.parametrize("mode", ["causal", "bidirectional"])
def test_top_on_bottom_output_equals_full_model(model, mode):
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 97, (3, 17)))
    seg = jnp.asarray(np.array([[1] * 17, [1] * 11 + [0] * 6, [1] * 5 + [0] * 12]), jnp.int32)
    bottom, top = split_model(model, 2)

    @jax.jit
    def both(ids, seg):
        x = bottom.residual(ids, _pos(ids.shape), seg, mode=mode)
        return model(ids, _pos(ids.shape), seg, mode=mode), top(ids, _pos(ids.shape), seg, mode=mode, inputs_embeds=x)

    full, out = both(ids, seg)
    real = np.asarray(seg, bool)
    np.testing.assert_allclose(np.asarray(out.logits)[real], np.asarray(full.logits)[real], atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.kv.k), np.asarray(full.kv.k)[2:], atol=1e-5)
    assert top.config.num_layers == 2 and bottom.config.num_layers == 2
    with pytest.raises(ValueError, match="inputs_embeds shape"):
        top(ids, _pos(ids.shape), seg, inputs_embeds=jnp.zeros((3, 5, 32)))
    with pytest.raises(ValueError, match="top_layers=4"):
        split_model(model, 4)


def test_merge_top_replaces_only_the_top(model):
    _, top = split_model(model, 2)
    trained = jax.tree.map(lambda a: a + 1.0, nnx.state(top, nnx.Param))
    merged = nnx.to_pure_dict(nnx.state(merge_top(model, trained), nnx.Param))
    orig = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    new = nnx.to_pure_dict(trained)
    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))  # noqa: E731
    assert same(merged["embedding"], orig["embedding"])
    assert same(merged["layers"][0], orig["layers"][0]) and same(merged["layers"][1], orig["layers"][1])
    assert same(merged["layers"][2], new["layers"][0]) and same(merged["layers"][3], new["layers"][1])
    assert same(merged["final_norm"], new["final_norm"])
    assert same(nnx.to_pure_dict(nnx.state(model, nnx.Param))["layers"][3], orig["layers"][3])  # model unchanged


def test_feature_table_padding_save_load(model, tmp_path):
    bottom, _ = split_model(model, 2)
    rng = np.random.default_rng(4)
    rows = [rng.integers(0, 97, n).astype(np.int32) for n in (3, 9, 17, 30, 5)]
    rows.insert(3, rows[2].copy())  # a repeated row is computed once
    frozen = FrozenBottom(bottom, batch_tokens=40, fingerprint="tiny|2")  # several batches of mixed lengths
    frozen.precompute("bidirectional", rows, progress=False)
    frozen.precompute("causal", rows[:2], progress=False)
    assert len(frozen) == 5 + 2  # the repeated row once
    residual = jax.jit(lambda t: bottom.residual(t, _pos(t.shape), jnp.ones(t.shape, jnp.int32), mode="bidirectional"))
    for r in rows:
        alone = residual(jnp.asarray(r[None]))[0]  # one row, no padding
        np.testing.assert_allclose(frozen.features("bidirectional", r), np.asarray(alone), atol=1e-5)
    tokens = np.zeros((2, 12), np.int32)
    tokens[0, :9], tokens[1, :3] = rows[1], rows[0]
    mask = (np.arange(12) < np.array([[9], [3]])).astype(np.int32)
    x = frozen.inputs_embeds("causal", tokens, mask)
    np.testing.assert_array_equal(x[0, :9], frozen.features("causal", rows[1]))
    assert not x[0, 9:].any() and not x[1, 3:].any()
    assert not np.array_equal(frozen.features("causal", rows[1]), frozen.features("bidirectional", rows[1]))
    frozen.save(tmp_path / "f.npz")
    again = FrozenBottom(bottom, fingerprint="tiny|2")
    again.load(tmp_path / "f.npz")
    assert len(again) == len(frozen)
    np.testing.assert_array_equal(again.features("bidirectional", rows[4]), frozen.features("bidirectional", rows[4]))
    with pytest.raises(ValueError, match="tiny\\|2"):
        FrozenBottom(bottom, fingerprint="other").load(tmp_path / "f.npz")
    with pytest.raises(KeyError, match="precompute"):
        frozen.features("causal", rows[4])


def _grit_batch(rng, b=4, g=2, lq=7, lp=11, lg=16):
    def rows(n, length, min_len):
        lens = rng.integers(min_len, length + 1, n)
        mask = (np.arange(length) < lens[:, None]).astype(np.int32)
        return rng.integers(1, 97, (n, length)).astype(np.int32) * mask, mask, lens

    qt, qa, _ = rows(b, lq, 3)
    pt, pa, _ = rows(b * g, lp, 4)
    gt, ga, glens = rows(2, lg, 8)
    qp, pp = qa.copy(), pa.copy()
    qp[:, :2], pp[:, :1] = 0, 0  # the instruction / format prefix is not pooled
    gl = np.zeros_like(ga)
    for i, n in enumerate(glens):
        gl[i, n - 3:n] = 1  # the response: the last 3 real tokens
    return {"query_tokens": qt, "query_attention_mask": qa, "query_pool_mask": qp,
            "passage_tokens": pt, "passage_attention_mask": pa, "passage_pool_mask": pp,
            "gen_tokens": gt, "gen_attention_mask": ga, "gen_loss_mask": gl}


def _with_features(frozen, batch):
    out = dict(batch)
    for side, mode in (("query", "bidirectional"), ("passage", "bidirectional"), ("gen", "causal")):
        tokens, mask = batch[f"{side}_tokens"], batch[f"{side}_attention_mask"]
        frozen.precompute(mode, [t[:int(m.sum())] for t, m in zip(tokens, mask)], progress=False)
        out[f"{side}_inputs_embeds"] = frozen.inputs_embeds(mode, tokens, mask)
    return out


def test_grit_loss_and_gradients_on_features_equal_full_model(model):
    """The top's GRIT loss on cached bottom features (with the generative logits window) = the full model's loss on
    tokens, and its gradients = the full model's gradients of the corresponding (top) parameters."""
    batch = _grit_batch(np.random.default_rng(5))
    bottom, top = split_model(model, 2)
    fbatch = _with_features(FrozenBottom(bottom), batch)
    full_loss = GritLoss(GritConfig(mode="unified"))
    top_loss = GritLoss(GritConfig(mode="unified", gen_window=4))  # response (3) + the token before it

    def grads(m, loss_fn, b):
        graphdef, params = nnx.split(m)
        step = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(nnx.merge(graphdef, p), b), has_aux=True))
        (_, metrics), g = step(params, b)
        return metrics, nnx.to_pure_dict(g)

    m_full, g_full = grads(model, full_loss, batch)
    m_top, g_top = grads(top, top_loss, fbatch)
    for k in ("loss", "loss_rep", "loss_gen", "rep_accuracy", "gen_accuracy"):
        np.testing.assert_allclose(float(m_top[k]), float(m_full[k]), rtol=1e-5, err_msg=k)
    for i in range(2):
        for a, b in zip(jax.tree.leaves(g_top["layers"][i]), jax.tree.leaves(g_full["layers"][2 + i])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * np.abs(np.asarray(b)).max())
    b = np.asarray(g_full["final_norm"]["scale"])
    np.testing.assert_allclose(np.asarray(g_top["final_norm"]["scale"]), b, atol=1e-5 * np.abs(b).max())
    # A window that cuts the response drops targets: the value changes (the window is not a no-op).
    short, _ = grads(top, GritLoss(GritConfig(mode="unified", gen_window=2)), fbatch)
    assert abs(float(short["loss_gen"]) - float(m_full["loss_gen"])) > 1e-4
    with pytest.raises(ValueError, match="gen_window"):
        GritConfig(gen_window=1)


def test_partial_training_keeps_embedding_bit_exact(model):
    from rag_jax import sharding
    from rag_jax.train import optim, trainer

    bottom, top = split_model(model, 2)
    frozen = FrozenBottom(bottom)
    rng = np.random.default_rng(6)
    batches = [_with_features(frozen, _grit_batch(rng)) for _ in range(3)]
    run_cfg = trainer.RunConfig(
        model=top.config, mesh=sharding.MeshConfig(data=1, fsdp=1, tensor=1),
        optimizer=optim.OptimizerConfig(learning_rate=1e-2, warmup_steps=0, weight_decay=0.1, trainable=TOP_TRAINABLE),
        train=trainer.TrainConfig(steps=3, log_every=1), logging=trainer.LoggingConfig(progress_bar=False))
    task = trainer.Task(GritLoss(GritConfig(gen_window=4)), lambda step: batches[step], name="GRIT top")
    result = trainer.run(run_cfg, task, init_params=nnx.state(top, nnx.Param),
                         mesh=jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), devices=jax.devices()[:1]))
    before, after = nnx.to_pure_dict(nnx.state(top, nnx.Param)), nnx.to_pure_dict(result.state.params)
    np.testing.assert_array_equal(np.asarray(after["embedding"]), np.asarray(before["embedding"]))
    for a, b in zip(jax.tree.leaves(after["layers"]), jax.tree.leaves(before["layers"])):
        assert not np.array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(after["final_norm"]["scale"]), np.asarray(before["final_norm"]["scale"]))
