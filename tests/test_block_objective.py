"""Block-Attention objective: block/full losses equal float64 cross-entropy computed from independent paths
(cached per-block inference for block mode, plain causal forward for full mode); weights, marker, training."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rag_jax.data.block_rag import BlockExample, collate
from rag_jax.inference.block_attention import BlockAttention
from rag_jax.inference.kv_store import KVStore
from rag_jax.model import ModelConfig, Transformer
from rag_jax.train.objectives.block import BlockLoss, block_loss

CFG = ModelConfig.tiny(max_seq_len=128)
SEQ = 48


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def _examples(seed):
    rng = np.random.default_rng(seed)
    out = []
    for n_blocks, resp in ((4, 5), (2, 3)):
        blocks = [rng.integers(1, CFG.vocab_size, int(rng.integers(2, 8))).tolist() for _ in range(n_blocks)]
        out.append(BlockExample(blocks, tuple(rng.integers(1, CFG.vocab_size, resp).tolist())))
    return out


@functools.partial(jax.jit, static_argnames=("graphdef", "loss_fn"))
def _loss(graphdef, state, batch, loss_fn):
    return loss_fn(nnx.merge(graphdef, state), batch, None)


def _nll64(logits, targets):
    logits = np.asarray(logits, np.float64)
    lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    return lse - logits[np.arange(len(targets)), targets]


def _block_path_nll(ba, ex):
    """Response NLLs via cached per-block inference: the response is part of the global last block."""
    last = list(ex.blocks[-1]) + list(ex.response)
    logits = np.asarray(ba.prefill([list(b) for b in ex.blocks[:-1]] + [last]).logits)
    r = len(ex.response)
    return _nll64(logits[-r - 1:-1], np.asarray(ex.response))


def _full_path_nll(ba, ex):
    logits = np.asarray(ba.prefill([ex.prompt + list(ex.response)], mode="full").logits)
    r = len(ex.response)
    return _nll64(logits[-r - 1:-1], np.asarray(ex.response))


def test_losses_match_independent_float64_references(model):
    examples = _examples(0)
    batch = {k: jnp.asarray(v) for k, v in collate(examples, SEQ).items()}
    graphdef, state = nnx.split(model)
    ba = BlockAttention(model, store=KVStore(1 << 24))
    block_nll = np.concatenate([_block_path_nll(ba, ex) for ex in examples])
    full_nll = np.concatenate([_full_path_nll(ba, ex) for ex in examples])
    loss, m = _loss(graphdef, state, batch, BlockLoss())
    np.testing.assert_allclose(float(m["loss_block"]), block_nll.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["loss_full"]), full_nll.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(loss), (block_nll.sum() + full_nll.sum()) / (2 * block_nll.size), rtol=1e-5)
    assert float(m["num_tokens"]) == block_nll.size == 8
    assert abs(float(m["loss_block"]) - float(m["loss_full"])) > 1e-4     # the two masks really differ
    loss_w, _ = _loss(graphdef, state, batch, BlockLoss(full_weight=1.0, block_weight=3.0))
    np.testing.assert_allclose(float(loss_w), (full_nll.sum() + 3 * block_nll.sum()) / (4 * block_nll.size), rtol=1e-5)
    loss_f, m_f = _loss(graphdef, state, batch, BlockLoss(block_weight=0.0))
    np.testing.assert_allclose(float(loss_f), full_nll.mean(), rtol=1e-5)
    assert float(m_f["loss_block"]) == 0.0


def test_marker_loss_matches_marked_inference(model):
    examples, marker = _examples(1), (7, 8, 9)
    batch = {k: jnp.asarray(v) for k, v in collate(examples, SEQ).items()}
    graphdef, state = nnx.split(model)
    ba = BlockAttention(model, store=KVStore(1 << 24), marker_ids=marker)
    block_nll = np.concatenate([_block_path_nll(ba, ex) for ex in examples])
    full_nll = np.concatenate([_full_path_nll(ba, ex) for ex in examples])   # full mode never gets the marker
    _, m = _loss(graphdef, state, batch, BlockLoss(marker_ids=marker))
    np.testing.assert_allclose(float(m["loss_block"]), block_nll.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["loss_full"]), full_nll.mean(), rtol=1e-5)


def test_padding_rows_and_bad_config(model):
    graphdef, state = nnx.split(model)
    empty = {k: jnp.zeros_like(jnp.asarray(v)) for k, v in collate(_examples(2), SEQ).items()}
    loss, m = _loss(graphdef, state, empty, BlockLoss(marker_ids=(3,)))
    assert float(loss) == 0.0 and float(m["num_tokens"]) == 0.0
    with pytest.raises(ValueError, match="block_weight"):
        BlockLoss(full_weight=0.0, block_weight=0.0)
    with pytest.raises(ValueError, match="missing \\['is_global'\\]"):
        block_loss(model, {k: v for k, v in empty.items() if k != "is_global"})


def test_training_steps_reduce_both_losses(model):
    batch = {k: jnp.asarray(v) for k, v in collate(_examples(3), SEQ).items()}
    graphdef, state = nnx.split(Transformer(CFG, rngs=nnx.Rngs(4)))
    params = state
    opt = optax.adam(3e-3)
    opt_state = opt.init(params)
    loss_fn = BlockLoss(marker_ids=(1,))

    @jax.jit
    def step(params, opt_state):
        (loss, m), grads = jax.value_and_grad(lambda p: _loss(graphdef, p, batch, loss_fn), has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, m

    first = None
    for _ in range(15):
        params, opt_state, m = step(params, opt_state)
        first = first or {k: float(v) for k, v in m.items()}
    assert float(m["loss_block"]) < 0.7 * first["loss_block"]
    assert float(m["loss_full"]) < 0.7 * first["loss_full"]


@pytest.mark.parametrize("window", [None, 6, SEQ])
def test_mixed_loss_matches_independent_float64_references(model, window):
    """``MixedBlockLoss`` on ``mixed_batch`` = the token mean of the cached per-block path's and the plain causal
    path's response NLLs (one forward; logits only over the last ``window`` tokens: max response 5 + 1)."""
    from rag_jax.data.block_rag import mixed_batch
    from rag_jax.train.objectives.block import MixedBlockLoss
    examples = _examples(5)
    graphdef, state = nnx.split(model)
    ba = BlockAttention(model, store=KVStore(1 << 24))
    block_nll = np.concatenate([_block_path_nll(ba, ex) for ex in examples])
    full_nll = np.concatenate([_full_path_nll(ba, ex) for ex in examples])
    batch = {k: jnp.asarray(v) for k, v in mixed_batch(examples, SEQ).items()}
    loss, m = _loss(graphdef, state, batch, MixedBlockLoss(response_window=window))
    np.testing.assert_allclose(float(m["loss_block"]), block_nll.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["loss_full"]), full_nll.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(loss), np.concatenate([block_nll, full_nll]).mean(), rtol=1e-5)
    assert float(m["num_tokens"]) == 2 * block_nll.size == 16
    assert abs(float(m["loss_block"]) - float(m["loss_full"])) > 1e-4
    ref, _ = _loss(graphdef, state, {k: jnp.asarray(v) for k, v in collate(examples, SEQ).items()}, BlockLoss())
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-6)
    with pytest.raises(ValueError, match="response_window=1"):
        MixedBlockLoss(response_window=1)
