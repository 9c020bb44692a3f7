"""Block-Attention self-distillation (rag_jax.recipes.block_attention.distill, objectives.block_distill) against float64 NumPy
computed from the whole model's own logits: the cached features (teacher states, log-probabilities of both modes),
the loss value, the cache (hits equal, a changed model misses), a short run (the full pass starts at KL 0, the
frozen bottom stays bit-identical, the HF export loads back), and the paired statistics."""
import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rag_jax.data.block_rag import BlockExample
from rag_jax.tokenizer import byte_tokenizer
from rag_jax.model import ModelConfig, Transformer
from rag_jax.recipes.block_attention.block_distill import same_bottom
from rag_jax.model.load import LoadedModel, load_model
from rag_jax.recipes.block_attention.distill import (DistillConfig, DistillFeatures, answer_loglik, answer_logprobs,
                                         distill, distill_batch, export_hf, shape_batches, target_positions)
from rag_jax.inference.block_prefix import block_parts
from rag_jax.train.frozen_bottom import split_model
from rag_jax.train.objectives.block_distill import BlockDistillLoss

CFG = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=2, num_kv_heads=1,
                  max_seq_len=128, tie_embeddings=True)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "<|im_start|>assistant\n")


def _model(seed, cfg=CFG):
    m = Transformer(cfg, rngs=nnx.Rngs(seed))
    for i, norm in enumerate([m.final_norm] + [layer.input_norm for layer in m.layers]):  # random norm scales
        norm.scale[...] = 1.0 + 0.3 * jax.random.normal(jax.random.key(seed + i), norm.scale.shape)
    for layer in m.layers:                                              # strong, sharp attention: the modes
        for w in (layer.attn.wq, layer.attn.wk, layer.attn.wv, layer.attn.wo):  # differ clearly
            w[...] = w[...] * 4
    return m


def _examples(rng, n):
    return [BlockExample([rng.integers(1, 256, int(rng.integers(2, 9))).tolist() for _ in range(int(k))],
                         rng.integers(1, 256, int(rng.integers(2, 5))).tolist())
            for k in rng.integers(3, 6, n)]


def _log_softmax64(logits):
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _both_modes(graphdef, state, a):
    model = nnx.merge(graphdef, state)
    full = model(a["tokens"], a["positions"], a["segment_ids"], mode="causal")
    block = model(a["tokens"], a["positions"], a["segment_ids"], mode="block", is_global=a["is_global"])
    return full.logits, block.logits, full.hidden


def _reference(model, ex):
    """float64 log-probabilities ``[n, vocab]`` of the whole model in causal and in block mode over ``ex`` (right-
    padded to 64 tokens, which neither mask attends to: one compiled shape for every test example)."""
    a = {k: jnp.asarray(v[None]) for k, v in ex.to_arrays(64).items()
         if k in ("tokens", "positions", "segment_ids", "is_global")}
    full, block, hidden = (np.asarray(x[0, :ex.num_tokens], np.float64) for x in _both_modes(*nnx.split(model), a))
    return _log_softmax64(full), _log_softmax64(block), hidden


@functools.partial(jax.jit, static_argnames=("graphdef", "full_weight"))
def _loss(graphdef, state, batch, full_weight):
    return BlockDistillLoss(full_weight=full_weight)(nnx.merge(graphdef, state), batch)


def loss_of(top, batch, full_weight):
    """``BlockDistillLoss(full_weight)(top, batch)``, compiled (eager, each op compiles alone: 8 s a call)."""
    return _loss(*nnx.split(top), {k: jnp.asarray(v) for k, v in batch.items()}, full_weight)


def test_target_positions():
    ex = BlockExample([[5, 6, 7], [8, 9], [10, 11, 12]], [13, 14])
    t, is_resp = target_positions(ex)
    assert t.tolist() == [5, 6, 7, 8] and is_resp.tolist() == [False, False, True, True]  # predict 11 12 | 13 14
    assert target_positions(BlockExample([[1, 2], [3]], [4]))[0].tolist() == [2]
    with pytest.raises(ValueError, match="no target"):
        target_positions(BlockExample([[1, 2], [3]]))


def test_features_and_loss_match_the_whole_model_in_float64(tmp_path):
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 20))
    model = _model(seed)
    examples = _examples(rng, 5)
    feats = DistillFeatures(model, 2, cache_dir=tmp_path, batch_tokens=512).compute(examples, progress=False)
    kls = []
    for ex, f in zip(examples, feats):
        ref_full, ref_block, hidden = _reference(model, ex)
        t, _ = target_positions(ex)
        nxt = np.asarray(ex.prompt + list(ex.response))[t + 1]
        np.testing.assert_allclose(f["logp_full"], ref_full[t, nxt], atol=2e-5)
        np.testing.assert_allclose(f["logp_block"], ref_block[t, nxt], atol=2e-5)
        np.testing.assert_allclose(f["teacher_hidden"], hidden[t], atol=2e-5)
        assert f["full_x"].shape == (ex.num_tokens, CFG.hidden_size)
        assert len(f["head_x"]) + len(f["passage_x"]) + len(f["tail_x"]) == ex.num_tokens
        p = np.exp(ref_full[t])
        kls.append(np.sum(p * (ref_full[t] - ref_block[t]), axis=-1))
    assert np.concatenate(kls).mean() > 1e-3                                    # the modes differ clearly
    # The loss over a batch: token mean of KL(full || block) over every target, block pass only, and with the full
    # pass (KL 0 at the base model: the student's full mode is the teacher).
    top = split_model(model, 2)[1]
    batch = distill_batch(examples, feats, 48, 16)
    loss, m = loss_of(top, batch, 0.0)
    want = np.concatenate(kls).mean()
    np.testing.assert_allclose(float(loss), want, rtol=1e-4, atol=1e-7)
    loss, m = loss_of(top, batch, 1.0)
    np.testing.assert_allclose(float(m["kl_block"]), want, rtol=1e-4, atol=1e-7)
    assert abs(float(m["kl_full"])) < 1e-5 and float(m["num_targets"]) == sum(len(k) for k in kls)
    np.testing.assert_allclose(float(loss), want / 2, rtol=1e-4, atol=1e-7)
    # answer_logprobs of the base top reproduces the cached log-probabilities in both modes.
    for mode, key in (("block", "logp_block"), ("full", "logp_full")):
        for got, f in zip(answer_logprobs(top, examples, feats, mode, batch_size=2), feats):
            np.testing.assert_allclose(got, f[key], atol=2e-5)


def test_feature_cache_hits_equal_and_a_changed_model_misses(tmp_path):
    rng = np.random.default_rng()
    model = _model(int(rng.integers(1 << 20)))
    examples = _examples(rng, 3)
    first = DistillFeatures(model, 1, cache_dir=tmp_path).compute(examples, progress=False)
    assert len(list(tmp_path.glob("*.npz"))) == 3
    again = DistillFeatures(model, 1, cache_dir=tmp_path)
    second = again.compute(examples, progress=False)                     # from the files
    for a, b in zip(first, second):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    model.layers[0].mlp.down[...] = model.layers[0].mlp.down[...] * 1.5  # in place: the weights change
    changed = DistillFeatures(model, 1, cache_dir=tmp_path).compute(examples, progress=False)
    assert len(list(tmp_path.glob("*.npz"))) == 6                          # misses, new files
    assert not np.allclose(changed[0]["logp_full"], first[0]["logp_full"])
    ref_full = _reference(model, examples[0])[0]
    t = target_positions(examples[0])[0]
    nxt = np.asarray(examples[0].prompt + list(examples[0].response))[t + 1]
    np.testing.assert_allclose(changed[0]["logp_full"], ref_full[t, nxt], atol=2e-5)
    # training rows skip the block-mode pass: the same features but logp_block, which a later need recomputes
    lean = DistillFeatures(model, 1, cache_dir=tmp_path / "lean")
    rows = lean.compute(examples, progress=False, block_logp=False)
    for a, b in zip(rows, changed):
        assert np.isnan(a["logp_block"]).all()
        for k in a:
            if k != "logp_block":
                np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-6)
    again = DistillFeatures(model, 1, cache_dir=tmp_path / "lean")                # the lean rows come from files
    for a, b in zip(again.compute(examples, progress=False), changed):
        np.testing.assert_allclose(a["logp_block"], b["logp_block"], rtol=1e-6, atol=1e-6)


def test_answer_loglik_sums_response_tokens_without_the_end_of_turn():
    ex = BlockExample([[1, 2], [3, 4]], [5, 6, 7])                       # targets predict 4 | 5 6 7
    lp = np.asarray([-1.0, -2.0, -4.0, -8.0])
    assert answer_loglik([ex], [lp]).tolist() == [-6.0]
    assert answer_loglik([ex], [lp], drop_last=0).tolist() == [-14.0]


def test_distill_trains_the_top_only_and_exports_a_loadable_model(tmp_path):
    rng = np.random.default_rng()
    base = LoadedModel(CFG, _model(int(rng.integers(1 << 20))), "LlamaForCausalLM", byte_tokenizer(), TEMPLATE,
                       (10,), {"eos_token": "\n"}, Path("tiny-chat"))
    before = nnx.to_pure_dict(nnx.state(base.model, nnx.Param))
    before = jax.tree.map(np.asarray, before)
    examples = _examples(rng, 6)
    cfg = DistillConfig(top_layers=1, steps=3, batch_size=8, seq_len=48, max_targets=16, learning_rate=1e-2,
                        warmup_steps=0, save_every=1)
    tuned, result = distill(base, examples, cfg, tmp_path / "run")
    assert result.step == 3 and abs(result.history[0]["kl_full"]) < 1e-5 and result.history[0]["kl_block"] > 0
    after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(tuned, nnx.Param)))
    for i in range(CFG.num_layers):
        same = jax.tree.leaves(jax.tree.map(np.array_equal, before["layers"][i], after["layers"][i]))
        assert all(same) == (i < 3), i                                  # bottom bit-identical, top changed
    assert np.array_equal(before["embedding"], after["embedding"])
    assert same_bottom(base.model, tuned, 1) is None                    # eval block_distill --tuned accepts it
    assert "below the top 1 layers" in same_bottom(base.model, _model(int(rng.integers(1 << 20))), 1)
    # --tuned scores the tuned model through its own features: the same as its top over the base's features.
    base_feats = DistillFeatures(base.model, 1).compute(examples, progress=False)
    own = DistillFeatures(tuned, 1).compute(examples, progress=False)
    for mode, key in (("block", "logp_block"), ("full", "logp_full")):
        for got, f in zip(answer_logprobs(split_model(tuned, 1)[1], examples, base_feats, mode, batch_size=4), own):
            np.testing.assert_allclose(got, f[key], atol=2e-5)
    again, resumed = distill(base, examples, cfg, tmp_path / "run")     # a finished run resumes at its end
    assert resumed.start_step == 3
    out = export_hf(base, tuned, tmp_path / "hf", prefix="sink")
    loaded = load_model(out)
    assert loaded.block_prefix == "sink" and base.block_prefix == "none"
    assert loaded.chat_template == TEMPLATE and loaded.eos_ids == (10,) and loaded.tokenizer.encode("ab").ids == [97, 98]
    tokens = jnp.asarray(rng.integers(1, 256, (1, 12)), jnp.int32)
    pos, seg = jnp.arange(12)[None], jnp.ones((1, 12), jnp.int32)
    np.testing.assert_allclose(np.asarray(loaded.model(tokens, pos, seg).logits),
                               np.asarray(tuned(tokens, pos, seg).logits), atol=1e-5)
    with pytest.raises(ValueError, match="training row 0 has .* tokens"):
        distill(base, examples, DistillConfig(top_layers=1, seq_len=4), tmp_path / "other")


def test_distill_with_lora_changes_the_top_weights_by_rank_r_only(tmp_path):
    """``lora_rank``: the adapters are trained and folded in, so each top weight moves by a matrix of rank <= r
    (its singular values past r vanish), vectors (norms) and the bottom stay bit-identical."""
    rng = np.random.default_rng()
    base = LoadedModel(CFG, _model(int(rng.integers(1 << 20))), "LlamaForCausalLM", byte_tokenizer(), TEMPLATE,
                       (10,), {"eos_token": "\n"}, Path("tiny-chat"))
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(base.model, nnx.Param)))
    cfg = DistillConfig(top_layers=2, steps=3, batch_size=8, seq_len=48, max_targets=16, learning_rate=1e-2,
                        warmup_steps=0, save_every=3, lora_rank=2)
    tuned, result = distill(base, _examples(rng, 6), cfg, tmp_path / "run")
    assert result.step == 3 and tuned.config.lora_rank == 0
    assert abs(result.history[0]["kl_full"]) < 1e-5 and result.history[-1]["kl_block"] < result.history[0]["kl_block"]
    after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(tuned, nnx.Param)))
    for i in range(CFG.num_layers):
        for part, names in (("attn", ("wq", "wk", "wv", "wo")), ("mlp", ("gate", "up", "down"))):
            for name in names:
                w0, w1 = before["layers"][i][part][name], after["layers"][i][part][name]
                d = w1.astype(np.float64) - w0
                d = d.reshape(-1, d.shape[-1]) if name == "wo" else d.reshape(d.shape[0], -1)   # [in, out]
                s = np.linalg.svd(d, compute_uv=False)
                if i < 2:
                    assert not s.any(), (i, name)
                else:
                    assert s[1] > 1e-6 and s[2] < 1e-5 * s[0], (i, name, s[:4])
        assert np.array_equal(before["layers"][i]["input_norm"]["scale"], after["layers"][i]["input_norm"]["scale"])
    assert np.array_equal(before["final_norm"]["scale"], after["final_norm"]["scale"])
    with pytest.raises(ValueError, match="lora_rank=-1"):
        DistillConfig(lora_rank=-1)


def test_distill_config_and_untied_models_are_rejected_up_front():
    with pytest.raises(ValueError, match="full_weight=-1"):
        DistillConfig(full_weight=-1)
    with pytest.raises(ValueError, match="top_layers=0"):
        DistillConfig(top_layers=0)
    with pytest.raises(ValueError, match="tied embeddings"):
        DistillFeatures(Transformer(CFG.replace(tie_embeddings=False), rngs=nnx.Rngs(0)), 1)


def test_paired_statistics_match_their_definitions():
    from math import comb

    from rag_jax.evaluation.stats import mcnemar, paired_difference
    rng = np.random.default_rng()
    a, b = rng.random(60) < 0.5, rng.random(60) < 0.3
    only_a, only_b, p = mcnemar(a, b)
    n, k = only_a + only_b, min(only_a, only_b)
    assert (only_a, only_b) == (int(np.sum(a & ~b)), int(np.sum(~a & b)))
    np.testing.assert_allclose(p, min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2 ** n), rtol=1e-9)
    assert mcnemar([True, False], [True, False]) == (0, 0, 1.0)
    x, y = rng.normal(size=40), rng.normal(size=40)
    d = paired_difference(x, y)
    half = d["ci_high"] - d["mean"]
    from scipy import stats
    assert np.isclose(d["mean"], np.mean(x - y)) and np.isclose(half, stats.t.ppf(0.975, 39) * np.std(x - y, ddof=1)
                                                                 / np.sqrt(40))
    assert paired_difference(x + 5, x)["p"] < 1e-6 and paired_difference(x, x)["p"] == 1.0
    with pytest.raises(ValueError, match="paired"):
        mcnemar([True], [True, False])


def test_shared_prefix_block_logprobs_reduce_to_block_and_full_mode():
    """``inference.block_prefix.block_logprobs``: with no prefix it is block mode (the float64 reference through the
    block mask; a second implementation through KV caches); with block 0 as the prefix and one passage it is full
    attention (the passage then sits right after block 0, where full attention puts it); with two passages,
    neither; and ``BlockAttention(prefix=...)``, which caches each passage's KV, gives the same logits."""
    from rag_jax.inference.block_attention import BlockAttention
    from rag_jax.inference.block_prefix import block_logprobs
    rng = np.random.default_rng()
    model = _model(int(rng.integers(1 << 20)))
    one = BlockExample([rng.integers(1, 256, 5).tolist(), rng.integers(1, 256, 7).tolist(),
                        rng.integers(1, 256, 4).tolist()], rng.integers(1, 256, 3).tolist())
    two = BlockExample([*one.blocks[:2], rng.integers(1, 256, 6).tolist(), one.blocks[-1]], one.response)
    for ex in (one, two):
        ref_full, ref_block, _ = _reference(model, ex)
        t = target_positions(ex)[0]
        nxt = np.asarray(ex.prompt + list(ex.response))[t + 1]
        np.testing.assert_allclose(block_logprobs(model, ex), ref_block[t, nxt], atol=2e-5)
        if ex is one:
            np.testing.assert_allclose(block_logprobs(model, ex, prefix="system"), ref_full[t, nxt], atol=2e-5)
    shared = block_logprobs(model, two, prefix="system")
    assert np.abs(shared - ref_full[t, nxt]).max() > 1e-3 and np.abs(shared - ref_block[t, nxt]).max() > 1e-3
    sink = block_logprobs(model, two, prefix="sink")
    assert np.abs(sink - shared).max() > 1e-4
    for prefix, want in (("sink", sink), ("system", shared), ("none", ref_block[t, nxt])):
        blocks = [*two.blocks[:-1], list(two.blocks[-1]) + list(two.response)]
        logits = np.asarray(BlockAttention(model, prefix=prefix, pad_multiple=4).prefill(blocks).logits, np.float64)
        lp = _log_softmax64(logits)[:-1]
        np.testing.assert_allclose(lp[np.arange(len(lp)), np.asarray(blocks[-1][1:])], want, atol=2e-5)
    with pytest.raises(ValueError, match="prefix='first'"):
        block_logprobs(model, two, prefix="first")


def test_nosink_hides_each_passage_first_token_from_the_last_block_only():
    """``prefix="nosink"``: passages encoded alone as in plain block mode, but the last block does not see a
    passage's first token. Batched (``block_parts`` / ``prefix_block_residuals``) and cached
    (``BlockAttention.assemble``) give the same log-probabilities, different from plain block mode; distillation
    refuses to train it."""
    from rag_jax.inference.block_attention import BlockAttention
    from rag_jax.inference.block_prefix import block_logprobs
    rng = np.random.default_rng()
    model = _model(int(rng.integers(1 << 20)))
    head, last, resp = rng.integers(1, 256, 5).tolist(), rng.integers(1, 256, 4).tolist(), rng.integers(1, 256, 3).tolist()
    passages = [rng.integers(1, 256, int(n)).tolist() for n in rng.integers(3, 9, 3)]
    ex = BlockExample([head, *passages, last], resp)
    nosink = block_logprobs(model, ex, prefix="nosink")
    assert np.abs(nosink - block_logprobs(model, ex)).max() > 1e-4
    blocks = [*ex.blocks[:-1], list(last) + list(resp)]
    logits = np.asarray(BlockAttention(model, prefix="nosink", pad_multiple=4).prefill(blocks).logits, np.float64)
    lp = _log_softmax64(logits)[:-1]
    np.testing.assert_allclose(lp[np.arange(len(lp)), np.asarray(blocks[-1][1:])], nosink[-len(lp):], atol=2e-5)
    # the assembled cache: every passage's first slot hidden, everything else of the blocks visible, same keys
    plain, hid = (BlockAttention(model, prefix=p, pad_multiple=4).assemble([np.asarray(b, np.int32)
                                                                            for b in ex.blocks[:-1]])
                  for p in ("none", "nosink"))
    starts = np.cumsum([len(b) for b in ex.blocks[:-2]])
    want = np.asarray(plain.segment_ids).copy()
    want[0, starts] = 0
    np.testing.assert_array_equal(np.asarray(hid.segment_ids), want)
    np.testing.assert_array_equal(np.asarray(hid.k), np.asarray(plain.k))
    with pytest.raises(ValueError, match="training-free"):
        DistillConfig(prefix="nosink")


def test_sink_features_and_loss_follow_the_sink_inference():
    """With ``prefix="sink"`` the cached block log-probabilities are ``block_logprobs(prefix="sink")`` of the whole
    model, and the block pass of the loss is the KL of the teacher to exactly that distribution (float64)."""
    from rag_jax.inference.block_prefix import part_shapes, prefix_block_residuals
    rng = np.random.default_rng()
    model = _model(int(rng.integers(1 << 20)))
    examples = _examples(rng, 4)
    feats = DistillFeatures(model, 2, prefix="sink").compute(examples, progress=False)
    sink_logits = jax.jit(lambda graphdef, state, parts: (lambda m: m.logits(m.final_norm(
        prefix_block_residuals(m, parts)[2])))(nnx.merge(graphdef, state)), static_argnums=0)
    shapes = part_shapes(examples)                                      # one compiled shape
    kls = []
    for ex, f in zip(examples, feats):
        ref_full = _reference(model, ex)[0]
        t = target_positions(ex)[0]
        sink = _log_softmax64(sink_logits(*nnx.split(model), block_parts([ex], "sink", shapes))[0])[:len(t)]
        nxt = np.asarray(ex.prompt + list(ex.response))[t + 1]
        np.testing.assert_allclose(f["logp_block"], sink[np.arange(len(t)), nxt], atol=2e-5)
        assert int(f["prefix_len"]) == 1
        p = np.exp(ref_full[t])
        kls.append(np.sum(p * (ref_full[t] - sink), axis=-1))
    top = split_model(model, 2)[1]
    loss, m = loss_of(top, distill_batch(examples, feats, 48, 16), 0.0)
    np.testing.assert_allclose(float(loss), np.concatenate(kls).mean(), rtol=1e-4, atol=1e-7)
    for got, f in zip(answer_logprobs(top, examples, feats, "block", batch_size=3), feats):
        np.testing.assert_allclose(got, f["logp_block"], atol=2e-5)


def test_shape_batches_cover_every_example_once_in_shapes_that_hold_it():
    rng = np.random.default_rng()
    examples = [BlockExample([rng.integers(1, 256, int(n)).tolist() for n in rng.integers(1, 300, int(k))],
                             rng.integers(1, 256, 3).tolist()) for k in rng.integers(2, 7, 23)]
    batches = shape_batches(examples, 4, 4096)
    seen = sorted(i for idx, _, _ in batches for i in idx)
    assert seen == list(range(len(examples))) and all(len(idx) <= 4 for idx, _, _ in batches)
    for idx, width, shapes in batches:
        block_parts([examples[i] for i in idx], "none", shapes)      # raises if a row does not fit
        longest = max(len(b) for i in idx for b in examples[i].blocks[1:-1] or [[0]])
        assert width % 256 == 0 and width >= max(examples[i].num_tokens for i in idx)
        assert shapes["passage_len"] - longest < (64 if longest <= 256 else 128)


def test_length_buckets_and_the_flat_block_pass_leave_the_loss_unchanged(tmp_path):
    """``length_buckets``: full batches of several shapes; each batch's loss and gradients equal those of the same
    rows padded wider (padding is never attended) and those of the flat block pass (``flat_block_pass``: one
    block-masked forward over the row instead of passages encoded apart and re-encoded), and the trainer runs
    across an epoch, one compiled step per shape, its first step's loss that of the first batch of the seeded
    order under the base top."""
    rng = np.random.default_rng()
    cfg_model = dataclasses.replace(CFG, max_seq_len=1024)
    base = LoadedModel(cfg_model, _model(int(rng.integers(1 << 20)), cfg_model), "LlamaForCausalLM",
                       byte_tokenizer(), TEMPLATE, (10,), {"eos_token": "\n"}, Path("tiny-chat"))

    def example(passages):
        return BlockExample([rng.integers(1, 256, int(rng.integers(2, 9))).tolist(),
                             *[rng.integers(1, 256, int(n)).tolist() for n in passages],
                             rng.integers(1, 256, int(rng.integers(2, 9))).tolist()],
                            rng.integers(1, 256, int(rng.integers(2, 5))).tolist())

    examples = [example(rng.integers(2, 60, 2)) for _ in range(8)]      # short rows: width 256, passages 64
    examples += [example([150, 150]), example([140, 130, 120])] * 2        # long: width 512, passages 192
    examples += [example(rng.integers(2, 150, int(rng.integers(1, 4)))) for _ in range(int(rng.integers(3, 7)))]
    rng.shuffle(examples)
    features = DistillFeatures(base.model, 2)        # 2 top layers: the modes differ inside the top
    feats = features.compute(examples, progress=False, block_logp=False)
    groups = shape_batches(examples, 8, 512, fill=True)            # 8 rows: the test mesh's 8 devices
    assert all(len(idx) == 8 for idx, _, _ in groups) and {i for g in groups for i in g[0]} == set(range(len(examples)))
    assert len({(w, shp["passage_len"]) for _, w, shp in groups}) > 1
    top = split_model(base.model, 2)[1]
    top_def, top_state = nnx.split(top)

    def loss_and_grads(batch):
        f = lambda st: _loss(top_def, st, {k: jnp.asarray(v) for k, v in batch.items()}, 1.0)
        (loss, m), g = jax.value_and_grad(f, has_aux=True)(top_state)
        return float(loss), jax.tree.leaves(g)

    for idx, width, shp in groups:
        rows, fs = [examples[i] for i in idx], [feats[i] for i in idx]
        narrow = distill_batch(rows, fs, width, 16, shp)
        wide = distill_batch(rows, fs, 512 + 64, 16, {**shp, "passage_len": shp["passage_len"] + 64})
        assert narrow["tokens"].shape[1] < wide["tokens"].shape[1]
        flat = distill_batch(rows, fs, width, 16, shp, flat=True)
        assert "passage_tokens" not in flat and flat["block_inputs_embeds"].shape[1] == width
        (l1, g1), (l2, g2), (l3, g3) = loss_and_grads(narrow), loss_and_grads(wide), loss_and_grads(flat)
        assert l1 > 1e-4
        np.testing.assert_allclose(l1, l2, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(l3, l2, rtol=1e-4, atol=1e-7)
        for a, b, c in zip(g1, g2, g3):
            scale = 2e-5 * np.abs(np.asarray(b)).max() + 1e-9
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=scale)
            np.testing.assert_allclose(np.asarray(c), np.asarray(b), atol=scale)
    cfg = DistillConfig(top_layers=2, steps=len(groups) + 2, batch_size=8, seq_len=512, max_targets=16,
                        learning_rate=1e-3, warmup_steps=0, save_every=100, length_buckets=True,
                        flat_block_pass=True)
    _, result = distill(base, examples, cfg, tmp_path / "run", features=features)
    assert result.step == cfg.steps and len(result.history) == cfg.steps
    idx, width, shp = groups[np.random.default_rng([0, 0]).permutation(len(groups))[0]]
    want = loss_and_grads(distill_batch([examples[i] for i in idx], [feats[i] for i in idx], width, 16, shp))[0]
    np.testing.assert_allclose(result.history[0]["loss"], want, rtol=1e-4, atol=1e-7)
    assert {"length_buckets", "flat_block_pass"} <= set(cfg.record())
    assert not {"lora_rank", "length_buckets", "flat_block_pass"} & set(DistillConfig().record())
    with pytest.raises(ValueError, match="flat_block_pass needs prefix='none'"):
        DistillConfig(prefix="sink", flat_block_pass=True)


def test_em_table_scores_greedy_replies_and_its_reply_cache_is_keyed_by_the_weights(tmp_path, monkeypatch):
    """``em_table``: per condition, best-subspan EM of the greedy replies (as ``generate_answers`` gives them one
    prompt at a time), McNemar against full (base); a rerun is answered from ``em_replies.json`` without
    generating, and a model with other weights generates again."""
    from types import SimpleNamespace

    from rag_jax.recipes.block_attention import block_distill as bd
    from rag_jax.evaluation.rag import generate_answers
    from rag_jax.inference.block_attention import BlockAttention
    from rag_jax.metrics import best_subspan_em

    loaded = LoadedModel(CFG, _model(11), "LlamaForCausalLM", byte_tokenizer(), TEMPLATE, (10,),
                         {"eos_token": "\n"}, Path("tiny-chat"))
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    rows = [BlockExample([rng.integers(32, 120, int(n)).tolist() for n in rng.integers(3, 12, 3)], (65, 10))
            for _ in range(5)]
    direct = {mode: [generate_answers(BlockAttention(loaded.model), loaded.tokenizer, [r.blocks], mode=mode,
                                      max_new_tokens=4, batch_size=1, eos_id=(10,))[0] for r in rows]
              for mode in ("full", "block")}
    direct["T"] = [generate_answers(BlockAttention(loaded.model, passage_temperature=0.05), loaded.tokenizer,
                                    [r.blocks], mode="block", max_new_tokens=4, batch_size=1, eos_id=(10,))[0]
                   for r in rows]
    examples = [SimpleNamespace(answers=(direct["full"][i][:2] or "zz",) if i % 2 else ("zz",)) for i in range(5)]
    args = SimpleNamespace(max_new_tokens=4, em_batch_size=3, cache_dir=tmp_path)
    out = bd.em_table(loaded, {"base": (loaded.model, [("none", 1.0), ("none", 0.05)])}, examples, list(range(5)),
                      rows, args)
    assert out["full (base)"]["replies"] == direct["full"]
    assert out["block (base)"]["replies"] == direct["block"]
    assert out["block, T=0.05 (base)"]["replies"] == direct["T"] != direct["block"]   # its own cache key
    for cond, mode in (("full (base)", "full"), ("block (base)", "block")):
        expect = [bool(best_subspan_em(r, e.answers)) for e, r in zip(examples, direct[mode])]
        assert out[cond]["correct"] == expect and out[cond]["em"] == pytest.approx(np.mean(expect))
    assert 0 < sum(out["full (base)"]["correct"]) < 5
    calls = []
    monkeypatch.setattr(bd, "generate_answers", lambda ba, tok, prompts, **k: calls.append(len(prompts)) or
                        ["x"] * len(prompts))
    assert bd.em_table(loaded, {"base": (loaded.model, [("none", 1.0), ("none", 0.05)])}, examples, list(range(5)),
                       rows, args) == out
    assert not calls                                                    # every reply from the cache
    other = LoadedModel(CFG, _model(12), "LlamaForCausalLM", byte_tokenizer(), TEMPLATE, (10,),
                        {"eos_token": "\n"}, Path("tiny-chat"))
    again = bd.em_table(other, {"base": (other.model, [("none", 1.0)])}, examples, list(range(5)), rows, args)
    assert calls == [5, 5] and again["full (base)"]["replies"] == ["x"] * 5   # other weights: generated again


def test_attention_mass_table_finds_the_gold_block_and_averages_the_rows(capsys):
    """``--attention-mass``: the gold passage's block is found by its text; the table's per-layer categories are
    the mean over rows of ``attention_mass.categorize`` of each row (fresh rows, fresh gold positions)."""
    from rag_jax.data.chat_blocks import ChatBlocks
    from rag_jax.evaluation import attention_mass
    from rag_jax.recipes.block_attention.block_distill import gold_block, mass_table
    rng = np.random.default_rng()
    loaded = LoadedModel(CFG, _model(int(rng.integers(1 << 20))), "LlamaForCausalLM", byte_tokenizer(), TEMPLATE,
                         (10,), {"eos_token": "\n"}, Path("tiny-chat"))
    chat = ChatBlocks(loaded)
    rows, golds = [], []
    for i in range(3):
        texts = [f"p{i}{j} " + "x" * int(rng.integers(1, 5)) for j in range(4)]
        where = int(rng.integers(4))
        rows.append(BlockExample(chat.blocks(f"q{i}?", texts)))
        golds.append(gold_block(chat, rows[-1], texts[where]))
        assert golds[-1] == where + 1
    out = mass_table({"base": loaded.model}, rows, golds)
    assert "gold passage" in capsys.readouterr().out
    for mode in attention_mass.MODES:
        want = np.mean([attention_mass.categorize(attention_mass.block_attention_mass(loaded.model, r.blocks, mode),
                                                  g)["gold passage"] for r, g in zip(rows, golds)], axis=0)
        np.testing.assert_allclose(out[f"{mode} (base)"]["gold passage"], want, rtol=1e-12)
        first = np.mean([attention_mass.categorize(attention_mass.block_attention_mass(loaded.model, r.blocks, mode, 1),
                                                   g)["other passages"] for r, g in zip(rows, golds)], axis=0)
        np.testing.assert_allclose(out[f"{mode} (base)"]["other passages, first token"], first, rtol=1e-12)
        total = sum(np.asarray(out[f"{mode} (base)"][c]) for c in attention_mass.CATEGORIES)
        np.testing.assert_allclose(total, 1.0, atol=1e-5)
    with pytest.raises(ValueError, match="gold=0"):
        attention_mass.categorize(np.ones((2, 4)), 0)
