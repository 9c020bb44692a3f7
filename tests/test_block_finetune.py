"""Partial fine-tuning (``optimizer.trainable``) and Block-Attention fine-tuning of a pretrained chat model:
frozen parameters bit-identical after a step, trainable ones equal to optax on the trainable subset alone,
the run folder loads back with its chat template and resumes."""
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rag_jax import sharding
from rag_jax.data.block_rag import BlockExample, mixed_batch
from rag_jax.tokenizer import byte_tokenizer
from rag_jax.model import ModelConfig, Transformer
from rag_jax.model.load import LoadedModel, load_model
from rag_jax.train import optim, step as step_lib
from rag_jax.train.finetune import FinetuneConfig, finetune, top_layers
from rag_jax.train.objectives.block import MixedBlockLoss

CFG = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2, num_kv_heads=1,
                  max_seq_len=96)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "<|im_start|>assistant\n")


def _examples(seed, n=4, vocab=CFG.vocab_size):
    rng = np.random.default_rng(seed)
    return [BlockExample([rng.integers(1, vocab, int(rng.integers(2, 9))).tolist() for _ in range(int(k))],
                         rng.integers(1, vocab, int(rng.integers(1, 5))).tolist())
            for k in rng.integers(2, 5, n)]


def _leaves(params) -> dict[str, np.ndarray]:
    return {optim.param_path(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def test_top_layers_and_trainable_mask():
    pattern = top_layers(30, 2)
    abstract = nnx.split(nnx.eval_shape(lambda: Transformer(CFG.replace(num_layers=30), rngs=nnx.Rngs(0))))[1]
    mask = _leaves(optim.trainable_mask(optim.OptimizerConfig(trainable=pattern), abstract))
    assert {k for k, v in mask.items() if v} == {k for k in mask if k.startswith(("layers/28/", "layers/29/"))} | {
        "final_norm/scale"}
    assert len(mask) == 3 + 30 * 9 and "layers/2/attn/wq" in mask and not mask["embedding"] and not mask["lm_head"]
    assert top_layers(30, 0) is None and optim.trainable_mask(optim.OptimizerConfig(), abstract) is None
    with pytest.raises(ValueError, match="train_layers=31"):
        top_layers(30, 31)
    with pytest.raises(ValueError, match="not a regular expression"):
        optim.OptimizerConfig(trainable="layers/(")
    with pytest.raises(ValueError, match="matches no parameter; paths look like \\['embedding'"):
        optim.trainable_mask(optim.OptimizerConfig(trainable="^lora/"), abstract)


def test_frozen_parameters_are_bit_identical_after_a_step():
    """One train step with ``trainable`` = the top layer: the others are unchanged to the bit; the top layer's
    update equals clip + AdamW (weight decay on) applied by optax to the trainable parameters alone, with
    gradients of the unmasked loss. Adam's eps is 1e-4: its first step is g / (|g| + eps), so with the default
    1e-8 an entry whose gradient is near zero flips with the rounding difference between the compiled step and
    the reference gradient (one entry in 2,048 off by 1.8e-5 in about half the seeds); with 1e-4 the update is
    Lipschitz in g and the comparison tests the masking and the optimizer, not the rounding."""
    opt_cfg = optim.OptimizerConfig(learning_rate=1e-2, warmup_steps=0, weight_decay=0.1, grad_clip_norm=0.5,
                                    eps=1e-4, trainable=top_layers(CFG.num_layers, 1))
    tx = optim.make_optimizer(opt_cfg, 10)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
    seed = int(np.random.default_rng().integers(1 << 30))
    graphdef, state, shardings = step_lib.init_train_state(CFG, tx, mesh, seed=seed)
    params = jax.device_get(state.params)
    batch = {k: jnp.asarray(v) for k, v in mixed_batch(_examples(seed), 40).items()}
    loss_fn = MixedBlockLoss()
    train_step = step_lib.make_train_step(graphdef, tx, loss_fn, shardings, mesh,
                                          trainable=optim.trainable_mask(opt_cfg, state.params))
    new, metrics = train_step(state, batch)
    before, after = _leaves(params), _leaves(jax.device_get(new.params))
    trained = {k for k in before if k.startswith(("layers/2/", "final_norm/"))}
    assert len(trained) == 10
    for k in before.keys() - trained:
        assert np.array_equal(before[k], after[k]), k

    grads = jax.jit(jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch)[0]))(params)
    sub = lambda tree: {k: v for k, v in _leaves(tree).items() if k in trained}  # noqa: E731
    ref_tx = optax.chain(optax.clip_by_global_norm(0.5),
                         optax.adamw(1e-2, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps, weight_decay=0.1,
                                     mask=lambda t: {k: v.ndim >= 2 for k, v in t.items()}))
    updates, _ = ref_tx.update(sub(grads), ref_tx.init(sub(params)), sub(params))
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(sub(grads))), rtol=1e-5)
    for k in trained:
        np.testing.assert_allclose(after[k], before[k] + np.asarray(updates[k]), rtol=0, atol=2e-6)  # lr 1e-2 steps
        assert not np.array_equal(after[k], before[k]), k


def _tiny_chat_model(seed: int) -> LoadedModel:
    tok = byte_tokenizer()
    return LoadedModel(CFG, Transformer(CFG, rngs=nnx.Rngs(seed)), "LlamaForCausalLM", tok, TEMPLATE, (10,),
                       {"eos_token": "\n"}, Path("tiny-chat"))


def test_finetune_writes_a_run_folder_that_loads_and_resumes(tmp_path):
    base = _tiny_chat_model(int(np.random.default_rng().integers(1 << 30)))
    examples = _examples(1, n=8)
    cfg = FinetuneConfig(steps=2, batch_size=4, seq_len=48, train_layers=1, learning_rate=1e-2,
                              warmup_steps=0, save_every=1, log_every=1)
    base_params = _leaves(nnx.state(base.model, nnx.Param))
    result = finetune(base, examples, cfg, tmp_path / "run", extra_config={"data": {"n": 8}})
    assert result.step == 2 and {"loss_full", "loss_block"} <= result.history[-1].keys()

    tuned = load_model(tmp_path / "run")
    assert tuned.kind == "run" and tuned.chat_template == TEMPLATE and tuned.eos_ids == (10,)
    assert tuned.special_tokens == {"eos_token": "\n"} and tuned.tokenizer.encode("ab").ids == [97, 98]
    assert tuned.run_config["finetune"] == dataclasses.asdict(cfg)
    tuned_params = _leaves(nnx.state(tuned.model, nnx.Param))
    assert tuned_params.keys() == base_params.keys()
    for k, v in base_params.items():
        assert np.array_equal(v, tuned_params[k]) != k.startswith(("layers/2/", "final_norm/")), k

    again = finetune(base, examples, cfg, tmp_path / "run", extra_config={"data": {"n": 8}})
    assert again.start_step == 2 and again.step == 2
    with pytest.raises(ValueError, match="training example 0 has .* tokens \\(seq_len=4\\)"):
        finetune(base, examples, dataclasses.replace(cfg, seq_len=4), tmp_path / "other")


def test_finetune_with_lora_trains_the_top_adapters_and_loads_back(tmp_path):
    """``lora_rank``: only the adapters of the top ``train_layers`` move (every base parameter bit-identical), and
    the run folder loads with them folded in: the top layer's weights moved by rank-2 matrices, the rest equal;
    its rank-2 delta is exact."""
    from rag_jax.model.delta import low_rank_delta, relative_error
    from rag_jax.train.finetune import top_adapters
    base = _tiny_chat_model(int(np.random.default_rng().integers(1 << 30)))
    cfg = FinetuneConfig(steps=3, batch_size=4, seq_len=48, train_layers=1, learning_rate=1e-2, warmup_steps=0,
                         save_every=3, lora_rank=2)
    base_params = _leaves(nnx.state(base.model, nnx.Param))
    result = finetune(base, _examples(2, n=8), cfg, tmp_path / "run")
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    tuned = load_model(tmp_path / "run")
    assert tuned.run_config["model"].lora_rank == 2                     # trained with adapters, loaded folded
    params = _leaves(nnx.state(tuned.model, nnx.Param))
    assert tuned.config.lora_rank == 0 and params.keys() == base_params.keys()
    for k, v in params.items():                                         # only the top layer's projections moved
        moved = k.startswith("layers/2/") and k.split("/")[-1] in ("wq", "wk", "wv", "wo", "gate", "up", "down")
        assert np.array_equal(v, base_params[k]) != moved, k
    delta = low_rank_delta(base.model, tuned.model, 2)
    assert {k.split("/")[1] for k in delta} == {"2"}
    assert max(relative_error(base.model, tuned.model, delta).values()) < 1e-5
    assert top_adapters(3, 0).startswith("/lora_") and top_adapters(3, 1).startswith("^layers/(2)/")
    with pytest.raises(ValueError, match="lora_rank=-1"):
        FinetuneConfig(lora_rank=-1)


def test_nq_training_rows_fill_seq_len_with_ranked_negatives():
    from types import SimpleNamespace

    from rag_jax.data.chat_blocks import PASSAGE, ChatBlocks
    from rag_jax.recipes.block_attention.block_nq import training_examples
    rng = np.random.default_rng()
    loaded = _tiny_chat_model(0)
    chat = ChatBlocks(loaded)
    texts = ["".join(rng.choice(list("abcdefgh "), int(n))) + "." for n in rng.integers(5, 40, 30)]
    examples = [SimpleNamespace(question=f"q{i}?", answers=(f"ans{i}", "other")) for i in range(6)]
    gold_ids = rng.permutation(30)[:6].tolist()
    negatives = [[j for j in rng.permutation(30).tolist() if j != g][:5] for g in gold_ids]
    seq_len = 240
    rows, dropped = training_examples(chat, 10, examples, texts, gold_ids, range(6), negatives, seq_len, seed=1)
    assert dropped == 0 and len(rows) == 6
    ids = lambda text: loaded.tokenizer.encode(PASSAGE.format(text=text.strip())).ids  # noqa: E731
    for ex, i, neg, g in zip(rows, range(6), negatives, gold_ids):
        assert ex.response == (*b"ans%d" % i, 10) and ex.num_tokens <= seq_len
        passages = [list(b) for b in ex.blocks[1:-1]]
        k = len(passages) - 1
        assert sorted(map(tuple, passages)) == sorted(tuple(ids(texts[j])) for j in [g, *neg[:k]])
        assert k == len(neg) or ex.num_tokens + len(ids(texts[neg[k]])) > seq_len      # the next one does not fit
        assert ex.blocks[0] == tuple(chat.blocks("x", [])[0]) and ex.blocks[-1] == tuple(chat.blocks(f"q{i}?", [])[-1])
    assert len({[list(b) for b in ex.blocks[1:-1]].index(ids(texts[g])) for ex, g in zip(rows, gold_ids)}) > 1
    assert training_examples(chat, 10, examples, texts, gold_ids, range(6), negatives, 20, seed=1) == ([], 6)


def test_block_nq_evaluate_records_em_times_and_the_finetune_record(tmp_path):
    """``block_nq.evaluate`` on a tiny chat model: per condition and gold position the EM of its own predictions,
    wall and CPU seconds, and ``info`` (the fine-tuning record, NumPy floats included) in the --out JSON."""
    import json
    from types import SimpleNamespace

    from rag_jax.recipes.block_attention import block_nq
    from rag_jax.metrics import best_subspan_em
    cfg = dataclasses.replace(CFG, max_seq_len=512)
    loaded = LoadedModel(cfg, Transformer(cfg, rngs=nnx.Rngs(3)), "LlamaForCausalLM", byte_tokenizer(), TEMPLATE,
                         (10,), {"eos_token": "\n"}, Path("tiny-chat"))
    examples = [SimpleNamespace(question=f"q{i}?", answers=("a", "zz")) for i in range(3)]
    texts = [f"passage {j}." for j in range(5)]
    args = SimpleNamespace(batch_size=2, max_new_tokens=3, out=tmp_path / "out.json")
    info = {"finetune": {"steps": 1, "cpu_seconds": 2.5, "history": [{"loss": np.float32(1.5)}]}}
    results = block_nq.evaluate({" (after FT)": loaded}, examples, texts, [0, 1, 2], [0, 2], [[3, 4], [4, 3]],
                                [0, 2], args, info)
    saved = json.loads(args.out.read_text())
    assert list(results) == ["block (after FT)", "full (after FT)"] == list(saved["results"])
    assert saved["finetune"]["history"] == [{"loss": 1.5}] and saved["questions"] == 2
    for name, by_pos in results.items():
        for pos in (0, 2):
            row = by_pos[pos]
            em = np.mean([best_subspan_em(p, examples[i].answers) for p, i in zip(row["predictions"], [0, 2])])
            assert row["subspan_em"] == em and len(row["predictions"]) == 2
            assert row["seconds"] > 0 and row["cpu_seconds"] > 0
            assert saved["results"][name][str(pos)]["predictions"] == row["predictions"]
    args.modes = ["block"]
    only_block = block_nq.evaluate({"": loaded}, examples, texts, [0, 1, 2], [0], [[3, 4]], [2], args)
    assert list(only_block) == ["block"] and list(only_block["block"]) == [2]
    assert "finetune" not in json.loads(args.out.read_text())
    args.modes = ["closed"]                          # closed book: the question alone, the same replies per position
    closed = block_nq.evaluate({"": loaded}, examples, texts, [0, 1, 2], [0, 1], [[3, 4], [4, 3]], [0, 2], args)
    chat, ba = block_nq.ChatBlocks(loaded), block_nq.BlockAttention(loaded.model)
    want = block_nq.generate_answers(ba, loaded.tokenizer, [chat.blocks(f"q{i}?", []) for i in (0, 1)], mode="full",
                                     max_new_tokens=3, batch_size=2, eos_id=loaded.eos_ids)
    assert list(closed) == ["closed"] and closed["closed"][0]["predictions"] == closed["closed"][2]["predictions"] == want


def test_own_reply_targets_are_the_base_models_complete_greedy_replies(tmp_path):
    """``--train-targets base``: each kept row's response is the model's greedy full-attention reply to that row's
    prompt (decoded one prompt at a time here, batched and length-sorted there) + end of turn; replies cut at the
    cap are dropped; the cache file answers a rerun without generating."""
    from types import SimpleNamespace

    from rag_jax.data.block_rag import BlockExample, encode
    from rag_jax.recipes.block_attention import block_nq
    from rag_jax.evaluation.rag import generate_answers
    from rag_jax.inference.block_attention import BlockAttention
    cfg = dataclasses.replace(CFG, max_seq_len=512)
    loaded = LoadedModel(cfg, Transformer(cfg, rngs=nnx.Rngs(5)), "LlamaForCausalLM", byte_tokenizer(), TEMPLATE,
                         (10,), {"eos_token": "\n"}, Path("tiny-chat"))
    head = loaded.model.lm_head
    head[...] = head[...].at[:, 10].set(head[...][:, 32:120].mean(axis=1) * 100)  # ends some replies early
    rng = np.random.default_rng(3)
    rows = [BlockExample([rng.integers(32, 120, int(n)).tolist() for n in rng.integers(3, 30, 4)], (65, 10))
            for _ in range(12)]
    args = dict(model_key="tiny", max_tokens=8, batch_size=5, cache=tmp_path / "replies.json")
    out = block_nq.own_reply_examples(loaded, rows, **args)
    ba = BlockAttention(loaded.model, pad_multiple=128)                # one compiled prompt shape
    expected = []
    for r in rows:
        reply = generate_answers(ba, loaded.tokenizer, [r.blocks], mode="full", max_new_tokens=8, batch_size=1,
                                 eos_id=(10,))[0]
        if reply.strip() and len(encode(loaded.tokenizer, reply)) < 8:
            expected.append(BlockExample(r.blocks, (*encode(loaded.tokenizer, reply), 10)))
    assert 0 < len(expected) < len(rows)
    assert out == expected
    again = block_nq.own_reply_examples(dataclasses.replace(loaded, model=None), rows, **args)  # no model: cache only
    assert again == expected
    # keep_cut (a 2-token cap cuts some replies): those rows come back too, without the end of turn
    cut_args = {**args, "max_tokens": 2}
    replies = [generate_answers(ba, loaded.tokenizer, [r.blocks], mode="full", max_new_tokens=2, batch_size=1,
                                eos_id=(10,))[0] for r in rows]
    ends = [len(encode(loaded.tokenizer, t)) < 2 for t in replies]
    expected_all = [BlockExample(r.blocks, (*encode(loaded.tokenizer, t), *((10,) if e else ())))
                    for r, t, e in zip(rows, replies, ends) if t.strip()]
    kept = block_nq.own_reply_examples(loaded, rows, **cut_args, keep_cut=True)
    assert kept == expected_all and any(not e and t.strip() for t, e in zip(replies, ends))
    assert len(block_nq.own_reply_examples(loaded, rows, **cut_args)) < len(kept)


def test_full_mode_is_response_sft_under_causal_attention(tmp_path):
    """``modes="full"``: ``batch_size`` rows per step, all in full attention; the first step's loss is the
    token-mean NLL of the responses under causal attention of the base model (float64 reference from the
    model's logits of each example alone), and no block-mode loss is counted."""
    base = _tiny_chat_model(int(np.random.default_rng().integers(1 << 30)))
    examples = _examples(int(np.random.default_rng().integers(1 << 30)), n=8)
    cfg = FinetuneConfig(steps=1, batch_size=8, seq_len=48, train_layers=1, learning_rate=1e-2, warmup_steps=0,
                         save_every=1, log_every=1, modes="full")
    result = finetune(base, examples, cfg, tmp_path / "run")
    nll, count = 0.0, 0
    for ex in examples:
        tokens = np.asarray([t for b in ex.blocks for t in b] + list(ex.response), np.int32)
        n = len(tokens)
        hidden = base.model(tokens[None], np.arange(n, dtype=np.int32)[None], np.ones((1, n), np.int32),
                            mode="causal").hidden
        logits = np.asarray(base.model.logits(hidden), np.float64)[0]
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        start = n - len(ex.response)
        nll -= sum(logp[t - 1, tokens[t]] for t in range(start, n))
        count += len(ex.response)
    first = result.history[0]
    np.testing.assert_allclose(first["loss"], nll / count, rtol=2e-5)
    np.testing.assert_allclose(first["loss_full"], nll / count, rtol=2e-5)
    assert first["loss_block"] == 0.0
    with pytest.raises(ValueError, match="finetune modes='block'; valid: full\\+block, full"):
        FinetuneConfig(modes="block")
