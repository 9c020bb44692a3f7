"""Block-Attention inference: cached blocks + re-encoding == one block-mask forward; exact RoPE re-encoding;
batched generation == naive greedy decoding under the block mask; clear errors on bad prompts."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rag_jax.data.block_rag import BlockExample
from rag_jax.inference.block_attention import BlockAttention
from rag_jax.inference.kv_store import KVStore
from rag_jax.model import KVSegment, ModelConfig, Transformer, apply_rope, rope_inv_freq

CFG = ModelConfig.tiny(max_seq_len=256)


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def _blocks(rng, num_blocks, max_len=12, vocab=CFG.vocab_size):
    return [rng.integers(1, vocab, int(rng.integers(1, max_len + 1))).tolist() for _ in range(num_blocks)]


@functools.partial(jax.jit, static_argnames=("graphdef", "mode"))
def _logits(graphdef, state, tokens, positions, segment_ids, is_global, mode):
    return nnx.merge(graphdef, state)(tokens, positions, segment_ids, mode=mode, is_global=is_global).logits


def _forward(model, tokens, positions, segment_ids, is_global=None, mode="causal"):
    """Jitted reference forward of one row (eager NNX calls are slow on CPU)."""
    graphdef, state = nnx.split(model)
    args = [jnp.asarray(x)[None] for x in (tokens, positions, segment_ids)]
    glob = None if is_global is None else jnp.asarray(is_global)[None]
    return np.asarray(_logits(graphdef, state, *args, glob, mode)[0])


def _causal_logits(model, prompt):
    n = len(prompt)
    return _forward(model, np.asarray(prompt, np.int32), np.arange(n, dtype=np.int32), np.ones(n, np.int32))


def _block_mask_logits(model, blocks, response=(), width=64):
    """One forward over the whole prompt at global positions 0..N-1 with the core's block mask
    (right-padded to ``width`` so the reference compiles once; padding is never attended)."""
    ex = BlockExample(tuple(map(tuple, blocks)), tuple(response))
    a = ex.to_arrays(max(width, ex.num_tokens))
    out = _forward(model, a["tokens"], a["positions"], a["segment_ids"], a["is_global"], mode="block")
    return out[:ex.num_tokens]


@pytest.mark.parametrize("seed", range(4))
def test_cached_path_equals_block_mask_forward(model, seed):
    rng = np.random.default_rng(seed)
    blocks = _blocks(rng, int(rng.integers(2, 7)))
    ba = BlockAttention(model, store=KVStore(1 << 24))
    last = len(blocks[-1])
    expected = _block_mask_logits(model, blocks)[-last:]
    got = np.asarray(ba.prefill(blocks).logits)
    assert got.shape == (last, CFG.vocab_size)
    assert np.max(np.abs(got - expected)) <= 1e-5
    assert ba.store.stats["misses"] == len(blocks) - 1
    again = np.asarray(ba.prefill(blocks).logits)          # warm: every local block is a store hit
    assert ba.store.stats["hits"] == len(blocks) - 1
    np.testing.assert_array_equal(again, got)
    # The full-attention switch gives plain causal logits of the concatenated prompt, which differ.
    causal = _causal_logits(model, [t for b in blocks for t in b])
    full = np.asarray(ba.prefill(blocks, mode="full").logits)
    assert np.max(np.abs(full - causal[-last:])) <= 1e-5
    assert np.max(np.abs(full - got)) > 1e-3


def test_reused_block_at_a_new_offset(model):
    """The same cached passage reused at another position in another prompt stays exact."""
    rng = np.random.default_rng(7)
    shared, a, b, q = _blocks(rng, 4)
    ba = BlockAttention(model, store=KVStore(1 << 24))
    ba.prefill([shared, a, q])
    got = np.asarray(ba.prefill([b, a, shared, q]).logits)
    assert ba.store.stats["hits"] == 2                      # `a` and `shared` came from the store
    np.testing.assert_allclose(got, _block_mask_logits(model, [b, a, shared, q])[-len(q):], atol=1e-5, rtol=0)
    for mode in ("block", "full"):                          # time-to-first-token path: last row only
        last = np.asarray(ba.prefill([b, a, shared, q], mode=mode, last_only=True).logits)
        np.testing.assert_allclose(last, np.asarray(ba.prefill([b, a, shared, q], mode=mode).logits)[-1:],
                                   atol=1e-5, rtol=0)


def test_single_block_equals_plain_causal(model):
    rng = np.random.default_rng(3)
    block = rng.integers(1, CFG.vocab_size, 9).tolist()
    causal = _causal_logits(model, block)
    ba = BlockAttention(model, store=KVStore(1 << 24))
    np.testing.assert_allclose(np.asarray(ba.prefill([block]).logits), causal, atol=1e-5, rtol=0)
    np.testing.assert_allclose(_block_mask_logits(model, [block]), causal, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ba.prefill([block], mode="full").logits), causal, atol=1e-5, rtol=0)


def test_marker_matches_training_layout(model):
    """With marker ids, block inference == the block-mask forward of the objective's marked sequence."""
    from rag_jax.train.objectives.block import _prepend_marker
    rng = np.random.default_rng(11)
    blocks, marker = _blocks(rng, 3), (5, 6)
    a = {k: jnp.asarray(v)[None] for k, v in BlockExample(tuple(map(tuple, blocks))).to_arrays().items()}
    tokens, positions, seg, glob, _ = _prepend_marker(marker, a["tokens"], a["positions"], a["segment_ids"],
                                                      a["is_global"], a["loss_mask"])
    expected = _forward(model, tokens[0], positions[0], seg[0], glob[0], mode="block")[-len(blocks[-1]):]
    ba = BlockAttention(model, store=KVStore(1 << 24), marker_ids=marker)
    np.testing.assert_allclose(np.asarray(ba.prefill(blocks).logits), expected, atol=1e-5, rtol=0)


def _naive_block_greedy(model, blocks, steps):
    """Greedy decoding by recomputing one block-mask forward per step (generated tokens are global)."""
    out = []
    for _ in range(steps):
        logits = _block_mask_logits(model, blocks[:-1] + [blocks[-1] + out])
        out.append(int(np.argmax(logits[-1])))
    return out


def test_batched_generate_equals_naive_greedy(model):
    rng = np.random.default_rng(5)
    prompts = [_blocks(rng, 3), _blocks(rng, 1), _blocks(rng, 4)]     # caches of different lengths, one empty
    ba = BlockAttention(model, store=KVStore(1 << 24))
    got = ba.generate(prompts, max_new_tokens=4)
    assert got.shape == (3, 4)
    for row, blocks in zip(got, prompts):
        assert row.tolist() == _naive_block_greedy(model, blocks, 4)
    full = ba.generate(prompts, max_new_tokens=4, mode="full")
    for row, blocks in zip(full, prompts):                    # one block = plain causal attention
        assert row.tolist() == _naive_block_greedy(model, [[t for b in blocks for t in b]], 4)
    assert (full != got).any()


def _rope_f64(x, positions, theta, head_dim):
    """float64 NumPy RoPE (HF rotate_half layout) from the definition theta_i = base^(-2i/d)."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = positions[:, :, None, None].astype(np.float64) * np.concatenate([inv, inv])
    half = head_dim // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(ang) + rot * np.sin(ang)


def test_reencoding_is_exact_in_bf16_against_float64_rotation():
    """Keys stay pre-RoPE in bf16; moving a block any number of times only changes positions, so the
    attended key is one rotation of the stored key: within one bf16 rounding of the float64 rotation.
    The reference-code path (rotate, bf16, un-rotate, bf16, rotate, bf16 per move) drifts."""
    rng = np.random.default_rng(0)
    n, heads, d, theta = 64, 2, 32, 10000.0
    inv_freq = rope_inv_freq(d, theta)
    k_tilde = jnp.asarray(rng.standard_normal((1, 1, n, heads, d)), jnp.bfloat16)  # [layers, batch, len, h, d]
    seg = KVSegment(k=k_tilde, v=k_tilde, positions=jnp.arange(n, dtype=jnp.int32)[None],
                    segment_ids=jnp.ones((1, n), jnp.int32))
    offsets = [1000, 37, 3000, 5, 4000]
    moved = seg
    naive = apply_rope(k_tilde[0], seg.positions, inv_freq)          # reference code: rotated bf16 cache
    prev = seg.positions
    for o in offsets:
        moved = seg.with_positions(seg.positions + o)                  # ours: positions only
        new_pos = seg.positions + o
        unrotated = apply_rope(naive, -prev, inv_freq)                 # un-rotate -> bf16
        naive = apply_rope(unrotated, new_pos, inv_freq)               # re-rotate -> bf16
        prev = new_pos
    assert moved.k.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(moved.k, np.float32), np.asarray(k_tilde, np.float32))  # keys untouched
    ours = np.asarray(apply_rope(moved.k[0], moved.positions, inv_freq), np.float64)   # what attention sees
    ref = _rope_f64(np.asarray(k_tilde[0], np.float64), np.asarray(moved.positions), theta, d)
    # one bf16 rounding of the result + float32 angle error (|angle| <= 4063 rad: ~2.5e-4 rad)
    bf16_half_ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), 1e-30))) - 8)
    err_ours = np.abs(ours - ref)
    assert np.all(err_ours <= bf16_half_ulp + 1e-3), err_ours.max()
    # History-free: identical to rotating the stored keys once at the final positions.
    once = apply_rope(k_tilde[0], seg.positions + offsets[-1], inv_freq)
    np.testing.assert_array_equal(np.asarray(once, np.float32), np.asarray(ours, np.float32))
    # The un-rotate/re-rotate path is worse (bf16 rounding often snaps back, which limits its drift).
    err_naive = np.abs(np.asarray(naive, np.float64) - ref)
    assert err_naive.mean() > 1.3 * err_ours.mean(), (err_naive.mean(), err_ours.mean())


@pytest.mark.parametrize("blocks, kwargs, match", [
    ([], {}, "blocks is empty"),
    ([[1, 2], [], [3]], {}, "block 1 is empty"),
    ([[1] * 20, [2]], {"max_block_len": 16}, "block 0 has 20 tokens > max_block_len=16"),
    ([[1], [2], [3], [4]], {"max_blocks": 3}, "4 blocks exceed max_blocks=3"),
    ([[1] * 200, [2] * 60], {}, "exceeds the model maximum max_seq_len=256"),
    ([[1], [CFG.vocab_size]], {}, "outside"),
])
def test_bad_prompts_raise_clear_errors(model, blocks, kwargs, match):
    ba = BlockAttention(model, store=KVStore(1 << 20), fingerprint="tiny-0", **kwargs)
    with pytest.raises(ValueError, match=match):
        ba.prefill(blocks)
    assert ba.store.stats["misses"] == 0                     # nothing was computed


def test_generate_errors(model):
    ba = BlockAttention(model, store=KVStore(1 << 20), fingerprint="tiny-0")
    with pytest.raises(ValueError, match="prompts is empty"):
        ba.generate([], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"\+100 to generate\) = 260"):
        ba.generate([[[1] * 100, [2] * 60]], max_new_tokens=100)
    with pytest.raises(ValueError, match="mode="):
        ba.prefill([[1]], mode="sparse")


def test_store_is_shared_but_never_stale_across_models(model):
    """Two models with one store: same tokens, different fingerprints -> separate entries, right logits."""
    other = Transformer(CFG, rngs=nnx.Rngs(1))
    store = KVStore(1 << 24)
    rng = np.random.default_rng(9)
    blocks = _blocks(rng, 3)
    ba, bb = BlockAttention(model, store=store), BlockAttention(other, store=store)
    assert ba.fingerprint != bb.fingerprint
    ba.prefill(blocks)
    got = np.asarray(bb.prefill(blocks).logits)
    assert store.stats["hits"] == 0 and len(store) == 4
    np.testing.assert_allclose(got, _block_mask_logits(other, blocks)[-len(blocks[-1]):], atol=1e-5, rtol=0)
    bf16 = BlockAttention(Transformer(CFG.replace(dtype="bfloat16"), rngs=nnx.Rngs(0)), store=store)
    bf16.prefill(blocks)
    assert store.stats["hits"] == 0 and len(store) == 6                 # dtype differs -> miss


def _f64_block_logits(model, blocks, key_scale_of):
    """float64 NumPy forward of a Llama-style model over the concatenated ``blocks`` under Block-Attention's mask
    (a token of a local block sees its own block; the last block sees everything), with query i's logit to key
    j multiplied by ``key_scale_of(block of i, block of j)``; logits of the last block."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    owner = np.concatenate([np.full(len(b), i) for i, b in enumerate(blocks)])
    tokens = np.concatenate(blocks)
    n, last = len(tokens), len(blocks) - 1
    pos_q = np.arange(n)                                      # every block at its global offset (re-encoded)
    allowed = (owner[None, :] == owner[:, None]) | (owner[:, None] == last)
    allowed &= np.arange(n)[None, :] <= np.arange(n)[:, None]
    scale = np.array([[key_scale_of(owner[i], owner[j]) for j in range(n)] for i in range(n)])

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + CFG.rms_norm_eps) * w

    x = p["embedding"][tokens]
    group = CFG.num_heads // CFG.num_kv_heads
    for layer in p["layers"].values():
        h = norm(x, layer["input_norm"]["scale"])
        q = _rope_f64(np.einsum("td,dhk->thk", h, layer["attn"]["wq"])[None], pos_q[None], CFG.rope_theta,
                      CFG.head_dim)[0]
        k = _rope_f64(np.einsum("td,dhk->thk", h, layer["attn"]["wk"])[None], pos_q[None], CFG.rope_theta,
                      CFG.head_dim)[0]
        v = np.einsum("td,dhk->thk", h, layer["attn"]["wv"])
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        s = np.einsum("qhk,thk->hqt", q, k) / np.sqrt(CFG.head_dim) * scale[None]
        s = np.where(allowed[None], s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        x = x + np.einsum("hqt,thk,hkd->qd", w, v, layer["attn"]["wo"])
        h = norm(x, layer["post_attn_norm"]["scale"])
        g = h @ layer["mlp"]["gate"]
        x = x + (g / (1 + np.exp(-g)) * (h @ layer["mlp"]["up"])) @ layer["mlp"]["down"]
    return (norm(x, p["final_norm"]["scale"]) @ p["lm_head"])[-len(blocks[-1]):]


def test_passage_temperature_divides_the_logits_to_passage_keys(model):
    """``passage_temperature=T``: the last block's (and generated tokens') attention logits to the tokens of
    blocks 1..n-2 are divided by T; block 0 and the last block's own keys, and each passage's attention inside
    itself, are not (float64 NumPy reference of the whole model); stored blocks stay unscaled."""
    rng = np.random.default_rng()
    blocks = _blocks(rng, 4, max_len=10)
    t = float(rng.uniform(0.1, 0.25))                         # far from 1: the effect well above tolerance
    last = len(blocks) - 1
    ref = _f64_block_logits(model, blocks, lambda i, j: 1 / t if i == last and 0 < j < last else 1.0)
    plain = _f64_block_logits(model, blocks, lambda i, j: 1.0)
    np.testing.assert_allclose(_block_mask_logits(model, blocks)[-len(blocks[-1]):], plain, atol=2e-4, rtol=0)
    store = KVStore(1 << 24)
    got = np.asarray(BlockAttention(model, store=store, passage_temperature=t).prefill(blocks).logits)
    np.testing.assert_allclose(got, ref, atol=2e-4, rtol=0)
    assert np.abs(ref - plain).max() > 20 * np.abs(got - ref).max()   # the temperature changes the logits
    again = np.asarray(BlockAttention(model, store=store).prefill(blocks).logits)    # store hits: unscaled
    np.testing.assert_allclose(again, plain, atol=2e-4, rtol=0)
    # generation: each new token is part of the last block, so it sees the passages through T as well
    out = BlockAttention(model, store=store, passage_temperature=t).generate([blocks], max_new_tokens=3)[0].tolist()
    seq = []
    for _ in range(3):
        step = _f64_block_logits(model, blocks[:-1] + [blocks[-1] + seq],
                                 lambda i, j: 1 / t if i == last and 0 < j < last else 1.0)
        seq.append(int(np.argmax(step[-1])))
    assert out == seq
    with pytest.raises(ValueError, match="passage_temperature=0.0 must be > 0"):
        BlockAttention(model, passage_temperature=0.0)
