"""LM objective (rag_jax/train/objectives/lm.py) against a float64 NumPy reference, and packing isolation."""
import jax
import numpy as np
import pytest
from flax import nnx

from rag_jax.model import ModelConfig, Transformer
from rag_jax.train.objectives import LMLoss, lm_loss

CFG = ModelConfig.tiny(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, max_seq_len=64)


class _Jitted:
    """The model split once; logits and losses through jax.jit (eager NNX runs op by op: slow)."""

    def __init__(self):
        self.graphdef, self.params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(3)))
        self._loss = jax.jit(lambda p, batch, mode: lm_loss(nnx.merge(self.graphdef, p), batch, mode=mode),
                             static_argnums=2)
        self._logits = jax.jit(lambda p, batch: nnx.merge(self.graphdef, p)(
            batch["tokens"], batch["positions"], batch["segment_ids"], mode="block").logits)

    def loss(self, batch, mode="block"):
        return self._loss(self.params, batch, mode)

    def logits(self, batch):
        return self._logits(self.params, batch)


@pytest.fixture(scope="module")
def model():
    return _Jitted()


def _reference_loss(logits, tokens, segment_ids, loss_mask=None):
    """Mean -log softmax(logits[t])[tokens[t+1]] over pairs inside one non-padding segment (float64)."""
    logits = np.asarray(logits, np.float64)
    total, count = 0.0, 0.0
    for b in range(tokens.shape[0]):
        for t in range(tokens.shape[1] - 1):
            if segment_ids[b, t + 1] == 0 or segment_ids[b, t + 1] != segment_ids[b, t]:
                continue
            w = 1.0 if loss_mask is None else float(loss_mask[b, t + 1])
            row = logits[b, t]
            log_z = row.max() + np.log(np.exp(row - row.max()).sum())
            total += w * (log_z - row[tokens[b, t + 1]])
            count += w
    return total / count, count


def _packed_batch(rng, batch=3, seq=40):
    tokens = rng.integers(0, CFG.vocab_size, (batch, seq)).astype(np.int32)
    segment_ids = np.zeros((batch, seq), np.int32)
    positions = np.zeros((batch, seq), np.int32)
    lengths = []
    for b in range(batch):
        start, seg = 0, 1
        doc_lengths = []
        while start < seq - 6:
            n = int(rng.integers(3, 15))
            n = min(n, seq - 4 - start)  # leave a padded tail
            segment_ids[b, start:start + n] = seg
            positions[b, start:start + n] = np.arange(n)
            doc_lengths.append(n)
            start, seg = start + n, seg + 1
        lengths.append(doc_lengths)
    return {"tokens": tokens, "positions": positions, "segment_ids": segment_ids}, lengths


def test_loss_matches_float64_reference(model):
    batch, _ = _packed_batch(np.random.default_rng(0))
    loss, metrics = model.loss(batch)
    logits = model.logits(batch)
    want, count = _reference_loss(logits, batch["tokens"], batch["segment_ids"])
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    assert float(metrics["num_tokens"]) == count
    assert 0.0 <= float(metrics["accuracy"]) <= 1.0

    mask = np.random.default_rng(1).integers(0, 2, batch["tokens"].shape)
    masked, m2 = model.loss({**batch, "loss_mask": mask})
    want_masked, count_masked = _reference_loss(logits, batch["tokens"], batch["segment_ids"], mask)
    np.testing.assert_allclose(float(masked), want_masked, rtol=1e-5)
    assert float(m2["num_tokens"]) == count_masked


def test_packed_documents_do_not_see_each_other(model):
    """The loss of a packed row equals the token-weighted loss of each document run alone, causally."""
    batch, lengths = _packed_batch(np.random.default_rng(2), batch=2)
    packed_loss, packed_metrics = model.loss(batch, "block")
    # every document alone at the start of its own (padded) row, plain causal attention
    docs = [batch["tokens"][b, start:start + n] for b, doc_lengths in enumerate(lengths)
            for start, n in zip(np.cumsum([0] + doc_lengths[:-1]), doc_lengths)]
    width = max(len(d) for d in docs)
    alone = {"tokens": np.zeros((len(docs), width), np.int32), "positions": np.zeros((len(docs), width), np.int32),
             "segment_ids": np.zeros((len(docs), width), np.int32)}
    for i, d in enumerate(docs):
        alone["tokens"][i, :len(d)], alone["positions"][i, :len(d)], alone["segment_ids"][i, :len(d)] = (
            d, np.arange(len(d)), 1)
    alone_loss, alone_metrics = model.loss(alone, "causal")
    assert float(packed_metrics["num_tokens"]) == float(alone_metrics["num_tokens"]) == sum(
        n - 1 for doc_lengths in lengths for n in doc_lengths)
    np.testing.assert_allclose(float(packed_loss), float(alone_loss), rtol=1e-5)
    # causal mode on the same packed row lets documents attend across boundaries: a different loss
    leaky, _ = model.loss(batch, "causal")
    assert abs(float(leaky) - float(packed_loss)) > 1e-4


def test_no_target_gives_zero_not_nan(model):
    batch, _ = _packed_batch(np.random.default_rng(0))  # the shape compiled above
    batch["segment_ids"][:] = 0
    loss, metrics = model.loss(batch)
    assert float(loss) == 0.0 and float(metrics["num_tokens"]) == 0.0


def test_bad_batch_is_rejected(model):
    with pytest.raises(ValueError, match=r"missing \['segment_ids'\]"):
        model.loss({"tokens": np.ones((1, 4), np.int32), "positions": np.zeros((1, 4), np.int32)})
    with pytest.raises(ValueError, match="mode='bidirectional'"):
        model.loss({}, "bidirectional")
    with pytest.raises(ValueError, match="mode='bidirectional'"):
        LMLoss("bidirectional")


def test_loss_fn_is_a_hashable_static_argument():
    assert hash(LMLoss("block")) == hash(LMLoss("block")) and LMLoss("block") != LMLoss("causal")


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("chunk,s", [(1, 12), (1, 17), (6, 12), (4096, 12)])
def test_fused_nll_matches_full_logits(chunk, s, kernel, monkeypatch):
    """The fused head + cross-entropy (gradients computed chunk by chunk in the forward; on CPU the C++
    ``softmax_xent`` kernel or XLA): the loss, metrics and the gradients to hidden states, head and target
    weights of the full-logits loss, also under a scale. 11 chunks sum their head gradients one at a time, 16 in
    two groups of ``STACKED_CHUNKS``, 4 in one."""
    import jax.numpy as jnp

    from rag_jax.model import cpu_kernel
    from rag_jax.train.objectives import nll as nll_lib
    from rag_jax.train.objectives.nll import fused_next_token_nll, next_token_nll
    if kernel and not cpu_kernel.available():
        pytest.skip("no C++ compiler: the CPU kernels are not built")
    monkeypatch.setattr(nll_lib.cpu_kernel, "available", lambda: kernel)
    rng = np.random.default_rng()
    b, h, vocab = 2, 8, 50
    hidden = jnp.asarray(rng.standard_normal((b, s, h)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((h, vocab)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, vocab, (b, s)), jnp.int32)
    weights = jnp.asarray(rng.integers(0, 2, (b, s - 1)), jnp.float32)
    nll, hits, n = next_token_nll(jnp.einsum("bsh,hv->bsv", hidden, head), tokens, weights)
    total, hits_f, n_f = fused_next_token_nll(hidden, head, tokens, weights, chunk=chunk)
    for a, c in ((nll.sum(), total), (hits, hits_f), (n, n_f)):
        np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-5, atol=1e-5)

    def full(x, w, wt):
        return 3.0 * next_token_nll(jnp.einsum("bsh,hv->bsv", x, w), tokens, wt)[0].sum()

    def fused(x, w, wt):
        return 3.0 * fused_next_token_nll(x, w, tokens, wt, chunk=chunk)[0]
    grads = [jax.jit(jax.grad(f, argnums=(0, 1, 2)))(hidden, head, weights) for f in (full, fused)]
    for a, c in zip(*grads):
        np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-5, atol=1e-5)
