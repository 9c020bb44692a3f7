"""``rag_jax.model.xla_options``: long forward programs compile without YNNPACK fusions on CPU and compute the
same logits; ``generate`` compiles its prefill with them for long prompts and its decode loop without."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from rag_jax.inference import generate as G
from rag_jax.model import ModelConfig, Transformer
from rag_jax.model.xla_options import CPU_LONG_FORWARD_OPTIONS, LONG_FORWARD_ROWS, forward_options

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU options")


def test_forward_options_by_rows():
    assert forward_options(LONG_FORWARD_ROWS) == CPU_LONG_FORWARD_OPTIONS
    assert forward_options(LONG_FORWARD_ROWS - 1) == ()


def test_long_prefill_compiles_without_ynn_fusions_and_matches_the_default():
    rng = np.random.default_rng()
    cfg = ModelConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_seq_len=1024)
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30)))))
    b, n = 2, LONG_FORWARD_ROWS // 2 + 20
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, n)), jnp.int32)
    seg = jnp.ones((b, n), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    args = (graphdef, state, tokens, seg, pos, None)
    out, text = {}, {}
    for opts in ((), forward_options(b * n)):
        compiled = G._prefill_jit(opts).lower(*args, max_new_tokens=4).compile()
        text[opts], out[opts] = compiled.as_text(), compiled(state, tokens, seg, pos, None)[0]
    assert "__ynn_fusion" in text[()] and "__ynn_fusion" not in text[CPU_LONG_FORWARD_OPTIONS]
    assert float(jnp.abs(out[()]).max()) > 0.1
    np.testing.assert_allclose(out[CPU_LONG_FORWARD_OPTIONS], out[()], atol=2e-5, rtol=0)
    # generate: the long prompt's prefill is the option's program, and greedy replies continue its logits
    G._prefill_jit.cache_clear()
    reply = G.generate((graphdef, state), np.asarray(tokens), max_new_tokens=3)
    info = G._prefill_jit.cache_info()
    G._prefill_jit(CPU_LONG_FORWARD_OPTIONS)
    assert info.currsize == 1 and G._prefill_jit.cache_info().hits == info.hits + 1
    assert (reply[:, 0] == np.asarray(jnp.argmax(out[()], -1))).all()


def test_block_attention_forward_picks_the_options_by_width():
    from rag_jax.inference import block_attention as B
    rng = np.random.default_rng()
    cfg = ModelConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_seq_len=1024)
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30)))))
    B._forward_jit.cache_clear()
    tokens = rng.integers(0, cfg.vocab_size, LONG_FORWARD_ROWS + 40)
    long_logits, _ = B._padded_forward(graphdef, state, tokens, 0, None, 64, keep=1)
    short_logits, _ = B._padded_forward(graphdef, state, tokens[-200:], LONG_FORWARD_ROWS - 160, None, 64, keep=1)
    info = B._forward_jit.cache_info()
    B._forward_jit(CPU_LONG_FORWARD_OPTIONS), B._forward_jit(())
    assert info.currsize == 2 and B._forward_jit.cache_info().hits == info.hits + 2
    assert np.isfinite(long_logits).all() and np.isfinite(short_logits).all()
