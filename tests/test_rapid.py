"""RAPID (``rag_jax.inference.rapid``): the knowledge-transfer logits, acceptance and residual against a float64
NumPy transcription of the reference code (``John-AI-Lab/RAPID`` ``_speculative_sampling``), exactness of
speculative sampling at eta = 0, the decode streams' rewind, and the greedy loop against plain greedy decoding."""
import numpy as np
import pytest
from flax import nnx

from rag_jax.inference import rapid
from rag_jax.inference.generate import generate
from rag_jax.model import ModelConfig, Transformer

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_seq_len=256)


def _ref(zp, zq, eta, alpha):
    """The reference code's lines in float64: student = target, teacher = drafter."""
    sp = np.exp(zp - zp.max()) / np.exp(zp - zp.max()).sum()
    tp = np.exp(zq - zq.max()) / np.exp(zq - zq.max()).sum()
    gradient = sp - tp
    mask = tp >= alpha * tp.max()
    adjust = zp - eta * np.where(mask, gradient, 0.0)
    ap = np.exp(adjust - adjust.max()) / np.exp(adjust - adjust.max()).sum()
    p_prime = np.clip(np.maximum(sp - tp, sp - ap), 0, None)
    return adjust, ap, p_prime / p_prime.sum(), sp, tp


def test_transfer_acceptance_and_residual_match_the_reference():
    rng = np.random.default_rng()
    for _ in range(20):
        zp, zq = rng.normal(0, 2, 50), rng.normal(0, 2, 50)
        eta, alpha = float(rng.uniform(0, 3)), float(rng.uniform(0, 0.5))
        adjust, ap, p_prime, sp, tp = _ref(zp, zq, eta, alpha)
        np.testing.assert_allclose(rapid.transfer_logits(zp, zq, eta, alpha), adjust, rtol=0, atol=1e-12)
        np.testing.assert_allclose(rapid.residual(zp, zq, eta, alpha), p_prime, rtol=0, atol=1e-12)
        x = int(rng.integers(50))
        assert rapid.accept_probability(x, zp, zq, eta, alpha) == pytest.approx(min(1.0, ap[x] / tp[x]), abs=1e-12)
        dist = rapid.output_distribution(zp, zq, eta, alpha)
        kept = np.minimum(tp, ap)
        np.testing.assert_allclose(dist, kept + (1 - kept.sum()) * p_prime, atol=1e-12)
        assert dist.sum() == pytest.approx(1.0, abs=1e-12) and (dist >= 0).all()


def test_speculative_sampling_is_exact_without_transfer_and_leans_to_the_drafter_with_it():
    rng = np.random.default_rng()
    zp, zq = rng.normal(0, 2, 40), rng.normal(0, 2, 40)
    sp = np.exp(zp - zp.max()) / np.exp(zp - zp.max()).sum()
    np.testing.assert_allclose(rapid.output_distribution(zp, zq, 0.0), sp, atol=1e-12)
    tp = np.exp(zq - zq.max()) / np.exp(zq - zq.max()).sum()
    kl = lambda a, b: float(np.sum(a * np.log(a / b)))  # noqa: E731
    assert kl(tp, rapid.output_distribution(zp, zq, 2.0, 0.0)) < kl(tp, sp)
    with pytest.raises(ValueError, match="eta=-1 must be >= 0"):
        rapid.transfer_logits(zp, zq, -1)
    with pytest.raises(ValueError, match="alpha=2 must be in"):
        rapid.transfer_logits(zp, zq, 1.0, 2)


def _model(seed):
    return Transformer(CFG, rngs=nnx.Rngs(seed))


def test_stream_rewind_equals_a_stream_that_never_saw_the_dropped_tokens():
    rng = np.random.default_rng()
    model = _model(int(rng.integers(1 << 30)))
    prompt, extra = rng.integers(0, 64, 11).tolist(), rng.integers(0, 64, 4).tolist()
    s = rapid._Stream(model, prompt, 8)
    after_first = s.feed(extra[0])
    s.feed(extra[1])
    s.feed(extra[2])
    s.rewind(2, after_first)
    got = s.feed(extra[3])
    fresh = rapid._Stream(model, prompt + [extra[0], extra[3]], 2)
    np.testing.assert_allclose(got, fresh.logits, rtol=1e-4, atol=1e-4)


def test_greedy_rapid_without_transfer_is_the_targets_greedy_output():
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 30))
    target, drafter = _model(seed), _model(seed + 1)
    long_prompt, short_prompt = rng.integers(0, 64, 60).tolist(), rng.integers(0, 64, 12).tolist()
    reference = np.asarray(generate(target, [long_prompt], max_new_tokens=20)).reshape(-1).tolist()
    out, stats = rapid.rapid_generate(target, long_prompt, drafter, short_prompt, max_new_tokens=20, gamma=3)
    assert out == reference
    assert stats.accepted < stats.drafted and stats.rounds > 1       # rejections (and drafter rewinds) happened
    same, stats = rapid.rapid_generate(target, long_prompt, target, long_prompt, max_new_tokens=20, gamma=4)
    assert same == reference and stats.acceptance_rate == 1.0
    assert stats.target_steps == stats.rounds == 4                   # 4 drafted + 1 bonus token per round, one
    #                                                                  target call each
    with pytest.raises(ValueError, match="gamma=0"):
        rapid.rapid_generate(target, long_prompt, drafter, short_prompt, max_new_tokens=4, gamma=0)


def test_greedy_rapid_with_a_streaming_memory_target_is_its_greedy_output():
    """An EM-LLM target (contiguous positions, a memory holding every event: full attention's output) through
    ``verify`` / ``commit`` rounds: greedy eta=0 RAPID and the target alone give full attention's greedy tokens,
    over a prompt long enough to form events."""
    from rag_jax.memory import EMLLM, EMLLMConfig
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 30))
    model, drafter = _model(seed), _model(seed + 1)
    long_prompt, short_prompt = rng.integers(0, 64, 150).tolist(), rng.integers(0, 64, 12).tolist()
    em = EMLLM(model, EMLLMConfig(n_init=8, n_local=64, n_mem=2048, chunk_size=32, min_block_size=4,
                                  max_block_size=16, positions="contiguous"))
    reference = np.asarray(generate(model, [long_prompt], max_new_tokens=20)).reshape(-1).tolist()
    out, stats = rapid.rapid_generate(em, long_prompt, drafter, short_prompt, max_new_tokens=20, gamma=3)
    assert out == reference and stats.accepted < stats.drafted and stats.rounds > 1
    assert len(em.store) > 0 and em.segmenter.stream_len == len(long_prompt) + len(out) - 1
    alone, stats = rapid.stream_generate(em, long_prompt, max_new_tokens=20)
    assert alone == reference and stats.target_steps == 19


def test_stream_generate_is_greedy_decoding_and_compiles_nothing_while_it_decodes():
    """The target-alone baseline: the same tokens as ``generate``; every decode call was compiled with the
    prefill (the jitted step functions trace nothing during decoding), and it stops at an end id."""
    rng = np.random.default_rng()
    model = _model(int(rng.integers(1 << 30)))
    prompt = rng.integers(0, 64, int(rng.integers(20, 50))).tolist()
    reference = np.asarray(generate(model, [prompt], max_new_tokens=12)).reshape(-1).tolist()
    traced = rapid._step._cache_size()
    out, stats = rapid.stream_generate(model, prompt, max_new_tokens=12)
    assert out == reference and stats.target_steps == 11 and stats.seconds > 0 and stats.prefill_seconds > 0
    assert rapid._step._cache_size() == traced       # no call through the jitted step: it was compiled ahead
    stopped, stats = rapid.stream_generate(model, prompt, max_new_tokens=12, eos_id=reference[2])
    assert stopped == reference[:reference.index(reference[2]) + 1]
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        rapid.stream_generate(model, prompt, max_new_tokens=0)


def test_sampled_rapid_accepts_everything_from_an_identical_drafter_and_stops_at_eos():
    """Sampled verification with the drafter equal to the target on the same prompt: q = p = p~, so every drafted
    token is accepted (ratio 1) whatever eta; the same seed gives the same tokens; an end id stops at once."""
    rng = np.random.default_rng()
    target = _model(int(rng.integers(1 << 30)))
    prompt, seed = rng.integers(0, 64, 30).tolist(), int(rng.integers(1000))
    run = lambda **kw: rapid.rapid_generate(target, prompt, target, prompt, max_new_tokens=16, gamma=3,  # noqa: E731
                                             eta=1.0, temperature=1.0, seed=seed, **kw)
    out, stats = run()
    assert len(out) == 16 and stats.acceptance_rate == 1.0 and stats.rounds == 4   # 3 drafted + 1 bonus a round
    assert run()[0] == out
    stopped, _ = run(eos_id=out[0])
    assert stopped == out[:1]


def test_decode_bytes_counts_every_parameter_and_the_cached_keys_and_values():
    import jax
    model = _model(0)
    b = rapid.decode_bytes(CFG, 100, dtype_bytes=2)
    assert b["weights"] == 2 * sum(np.asarray(x).size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert b["kv"] == 2 * 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * 100


def test_rapid_eval_drafter_prompt_keeps_the_top_chunks_in_order():
    from rag_jax.evaluation.chunk_rag import chunks, rag_content

    haystack = ("The sky is blue. The grass is green.\nAlma Dunbarton's hobby is woodturning.\n"
                "Here we go. Bob's job is baker. The sun is yellow. ")
    assert "".join(chunks(haystack)) == haystack and len(chunks(haystack)) == 6
    parts = ("Read this.\n", haystack, "\nWhat is the hobby of Alma Dunbarton?")
    out = rag_content(parts, parts[2], 2)
    assert out.startswith(parts[0]) and out.endswith(parts[2])
    kept = out[len(parts[0]):-len(parts[2])]
    assert "Alma Dunbarton's hobby is woodturning." in kept and len(chunks(kept)) == 2
    assert kept == "".join(c for c in chunks(haystack) if c in kept)          # original order
