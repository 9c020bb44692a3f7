"""GRIT losses vs float64 NumPy references: InfoNCE (in-batch, hard and cross-device negatives on 8 fake
devices under shard_map) and the next-token loss with the ``mixed`` and ``token`` reductions."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax.train.objectives.grit import (GritConfig, _gather_keep_local_grad, group_size, info_nce,
                                           info_nce_local_negatives, info_nce_sharded, next_token_loss)
from rag_jax.train.objectives.nll import distill_kl

TEMP = 0.02


def np_info_nce(q, p, temperature, num_shards=1):
    """float64 loss and its analytic gradients (dL/dq, dL/dp) for shard-local (or global, 1 shard) negatives."""
    q, p = q.astype(np.float64), p.astype(np.float64)
    b, g = q.shape[0], p.shape[0] // q.shape[0]
    bs = b // num_shards
    losses, dq, dp = [], np.zeros_like(q), np.zeros_like(p)
    for s in range(num_shards):
        qs, ps = q[s * bs:(s + 1) * bs], p[s * bs * g:(s + 1) * bs * g]
        scores = qs @ ps.T / temperature
        m = scores.max(1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(scores - m).sum(1))
        tgt = np.arange(bs) * g
        losses.append(np.mean(lse - scores[np.arange(bs), tgt]))
        dscores = np.exp(scores - lse[:, None])
        dscores[np.arange(bs), tgt] -= 1.0
        dscores /= bs * num_shards
        dq[s * bs:(s + 1) * bs] = dscores @ ps / temperature
        dp[s * bs * g:(s + 1) * bs * g] = dscores.T @ qs / temperature
    return np.mean(losses), dq, dp


def unit_rows(rng, n, d):
    x = rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("g", [1, 2, 4])  # 1 = in-batch negatives only; >1 adds G-1 hard negatives per query
def test_info_nce_matches_numpy(g):
    rng = np.random.default_rng(g)
    q, p = unit_rows(rng, 8, 16), unit_rows(rng, 8 * g, 16)
    # Make the problem non-trivial: positives correlated with their queries.
    p[::g] = (p[::g] + 0.1 * q) / np.linalg.norm(p[::g] + 0.1 * q, axis=1, keepdims=True)
    ref, ref_dq, ref_dp = np_info_nce(q, p, TEMP)
    loss, (dq, dp) = jax.value_and_grad(info_nce, argnums=(0, 1))(jnp.asarray(q), jnp.asarray(p), TEMP)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(dq), ref_dq, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dp), ref_dp, rtol=1e-4, atol=1e-5)
    # Hard negatives matter: dropping them changes the loss.
    if g > 1:
        assert abs(float(info_nce(jnp.asarray(q), jnp.asarray(p[::g]), TEMP)) - ref) > 1e-3


@pytest.mark.parametrize("mesh_shape,axes", [((8,), ("data",)), ((2, 4), ("data", "fsdp"))])
@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("cross_device", [True, False])
def test_info_nce_sharded_8_devices(mesh_shape, axes, g, cross_device):
    """shard_map over 8 fake devices == single-device global computation (value and gradient)."""
    assert jax.device_count() == 8
    mesh = jax.make_mesh(mesh_shape, axes, axis_types=(jax.sharding.AxisType.Explicit,) * len(axes))
    rng = np.random.default_rng(10 * g + cross_device)
    q, p = unit_rows(rng, 16, 8), unit_rows(rng, 16 * g, 8)
    num_shards = 1 if cross_device else 8
    ref, ref_dq, ref_dp = np_info_nce(q, p, TEMP, num_shards)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axes))
    qj, pj = jax.device_put(q, sharding), jax.device_put(p, sharding)

    def f(q, p):
        return info_nce_sharded(q, p, mesh=mesh, data_axes=("data", "fsdp"), cross_device=cross_device,
                                temperature=TEMP)

    loss, (dq, dp) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(qj, pj)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5)
    # Each shard backpropagates only through its own slice; summed, that is exactly the global gradient.
    np.testing.assert_allclose(np.asarray(dq), ref_dq, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dp), ref_dp, rtol=1e-4, atol=1e-5)
    # The global (no shard_map) versions agree with the same reference.
    glob = info_nce(q, p, TEMP) if cross_device else info_nce_local_negatives(q, p, 8, TEMP)
    np.testing.assert_allclose(float(glob), ref, rtol=1e-5)
    # Cross-device negatives change the loss (more candidates) — the option is not a no-op.
    other = np_info_nce(q, p, TEMP, 8 if cross_device else 1)[0]
    assert abs(other - ref) > 1e-3


def test_gathered_negatives_carry_gradient_only_through_the_local_slice():
    """As the reference (all_gather under no_grad, local tensor put back): a shard's gradient of a
    function of the gathered batch is only the cotangent of its own rows."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((16, 3)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 3)), jnp.float32)

    def per_shard(x_local):
        return jax.grad(lambda xl: jnp.sum(w * _gather_keep_local_grad(xl, ("data",))))(x_local)

    spec = jax.sharding.PartitionSpec("data")
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
    grads = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=spec))(x)
    np.testing.assert_allclose(np.asarray(grads), np.asarray(w), rtol=1e-6)  # not 8x, not the full sum


def np_next_token(logits, tokens, mask, reduction, sub):
    logits = logits.astype(np.float64)[:, :-1]
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    tgt = tokens[:, 1:]
    ce = -np.take_along_axis(logp, tgt[..., None], -1)[..., 0]
    w = mask[:, 1:].astype(np.float64)
    b = tokens.shape[0]
    if reduction == "token":
        return (ce * w).sum() / b
    means = []
    for s in range(0, b, sub):
        n = w[s:s + sub].sum()
        if n > 0:
            means.append((ce[s:s + sub] * w[s:s + sub]).sum() / n)
    return np.mean(means)


@pytest.mark.parametrize("reduction,sub", [("mixed", None), ("mixed", 2), ("mixed", 3), ("token", None)])
def test_next_token_loss_matches_numpy(reduction, sub):
    rng = np.random.default_rng(7)
    b, length, vocab = 6, 9, 13
    logits = (3 * rng.standard_normal((b, length, vocab))).astype(np.float32)
    tokens = rng.integers(0, vocab, (b, length)).astype(np.int32)
    mask = (rng.random((b, length)) < 0.6).astype(np.int32)
    mask[0:2] = 0  # a sub-batch with no targets is left out of the "mixed" mean (sub=2)
    mask[2, :5] = 0
    mask[2, 5:] = 1
    loss, acc = next_token_loss(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(mask), reduction=reduction,
                                sub_batch_size=sub)
    ref = np_next_token(logits, tokens, mask, reduction, sub or b)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5)
    pred = logits[:, :-1].argmax(-1) == tokens[:, 1:]
    np.testing.assert_allclose(float(acc), (pred * mask[:, 1:]).sum() / mask[:, 1:].sum(), rtol=1e-6)


def test_mixed_and_token_reductions_differ_with_uneven_lengths():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((4, 8, 11)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 11, (4, 8)), jnp.int32)
    mask = jnp.asarray([[1] * 8, [0, 0, 0, 0, 0, 0, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1]])
    mixed = next_token_loss(logits, tokens, mask, reduction="mixed", sub_batch_size=2)[0]
    token = next_token_loss(logits, tokens, mask, reduction="token")[0]
    assert abs(float(mixed) - float(token)) > 1e-2


def test_distill_kl_matches_numpy_float64():
    rng = np.random.default_rng(11)
    b, length, vocab = 3, 7, 17
    logits = 2 * rng.standard_normal((b, length, vocab))
    teacher = 2 * rng.standard_normal((b, length, vocab))
    mask = (rng.random((b, length)) < 0.7).astype(np.int32)
    mask[1] = 0
    log_p = teacher - np.log(np.exp(teacher).sum(-1, keepdims=True))
    log_q = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ref = ((np.exp(log_p) * (log_p - log_q)).sum(-1) * mask).sum() / mask.sum()
    got = distill_kl(jnp.asarray(logits, jnp.float32), jnp.asarray(teacher, jnp.float32), jnp.asarray(mask))
    np.testing.assert_allclose(float(got), ref, rtol=1e-5)
    assert ref > 0.5
    assert float(distill_kl(jnp.asarray(teacher, jnp.float32), jnp.asarray(teacher, jnp.float32),
                            jnp.asarray(mask))) < 1e-6
    # the teacher gets no gradient; the model's gradient is softmax(logits) - softmax(teacher), over the count
    g_model, g_teacher = jax.grad(distill_kl, argnums=(0, 1))(jnp.asarray(logits, jnp.float32),
                                                             jnp.asarray(teacher, jnp.float32), jnp.asarray(mask))
    assert float(jnp.abs(g_teacher).max()) == 0.0
    ref_grad = (np.exp(log_q) - np.exp(log_p)) * mask[..., None] / mask.sum()
    np.testing.assert_allclose(np.asarray(g_model), ref_grad, atol=1e-6)
    with pytest.raises(ValueError, match="must agree"):
        distill_kl(jnp.ones((2, 3, 4)), jnp.ones((2, 3, 5)), jnp.ones((2, 3)))


def test_loss_input_errors():
    with pytest.raises(ValueError, match="multiple of num_queries"):
        group_size(4, 6)
    with pytest.raises(ValueError, match="num_queries=0"):
        group_size(0, 4)
    with pytest.raises(ValueError, match="multiple of num_queries"):
        info_nce(jnp.ones((3, 4)), jnp.ones((4, 4)))
    with pytest.raises(ValueError, match="gen_sub_batch_size=4 must divide"):
        next_token_loss(jnp.ones((6, 5, 3)), jnp.ones((6, 5), jnp.int32), jnp.ones((6, 5)), sub_batch_size=4)
    with pytest.raises(ValueError, match="reduction='sum'"):
        next_token_loss(jnp.ones((6, 5, 3)), jnp.ones((6, 5), jnp.int32), jnp.ones((6, 5)), reduction="sum")
    with pytest.raises(ValueError, match="loss_gen_type='mean'"):
        GritConfig(loss_gen_type="mean")
    with pytest.raises(ValueError, match="temperature"):
        GritConfig(temperature=0.0)
    with pytest.raises(ValueError, match="mode='both'"):
        GritConfig(mode="both")
