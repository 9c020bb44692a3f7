"""EM-LLM surprise segmentation vs a float64 NumPy emulation of the reference code (research note em_llm.md §2)."""
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax.memory import EMLLMConfig, form_events, surprise_from_logits
from rag_jax.memory.segmentation import EventSegmenter, surprise_threshold, threshold_window, uniform_flags


def reference_form_events(divide, min_size, max_size):
    """The reference loop of ``update_memory`` (cm.py 950-998), transcribed with explicit index lists."""
    n = len(divide)
    idx = [i for i, d in enumerate(divide) if d]
    if not idx:
        idx = list(range(0, n, max_size)) if n > max_size else [n]
    bounds = [0] + idx + [n]
    sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if b - a != 0]
    out, acc = [], 0
    for i, b in enumerate(sizes):
        acc += b
        while acc >= max_size:
            out.append(max_size)
            acc -= max_size
        if acc < min(min_size, n):
            continue
        if acc > 0 and i != len(sizes) - 1:
            out.append(acc)
        acc = 0
    return out


def reference_stream_events(surprise, chunk, n_local, n_init, gamma, min_size, max_size):
    """float64 emulation of the reference memory buffer over a whole stream with known surprise:
    returns the events as (stream start, size) and the number of init tokens."""
    rem_s, rem_d, rem_pos = [], [], []
    init_len, events = 0, []
    for st in range(0, len(surprise), chunk):
        s = np.asarray(surprise[st:st + chunk], np.float64)
        exc = len(s)
        rem_s += list(s)
        rem_d += [False] * exc
        rem_pos += list(range(st, st + exc))
        ed = len(rem_s)
        window = np.asarray(rem_s[max(ed - n_local, 0):max(ed - exc, n_init)], np.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            threshold = gamma * np.std(window, ddof=1) + np.mean(window)   # NaN for < 2 values, like torch
        rem_d[ed - exc:ed] = list(s > threshold)
        first, length = 0, ed
        if init_len < n_init and length > n_local:
            take = min(n_init - init_len, length - n_local)
            init_len += take
            first += take
            length -= take
        if length >= n_local + min_size:
            for size in reference_form_events(rem_d[first:first + length - n_local], min_size, max_size):
                events.append((rem_pos[first], size))
                first += size
        rem_s, rem_d, rem_pos = rem_s[first:], rem_d[first:], rem_pos[first:]
    return events, init_len


def run_segmenter(cfg, surprise):
    seg = EventSegmenter(cfg, cfg.n_local + cfg.chunk_size + cfg.max_block_size)
    events = []
    for st in range(0, len(surprise), cfg.chunk_size):
        chunk = surprise[st:st + cfg.chunk_size]
        start = seg.start
        cut = seg.push(len(chunk), chunk)
        pos = start + cut.init
        for size in cut.event_sizes:
            events.append((pos, size))
            pos += size
    return events, seg.init_len


def test_surprise_equals_float64_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 7, 31)).astype(np.float32) * 3
    nxt = rng.integers(0, 31, (2, 7))
    got = np.asarray(surprise_from_logits(jnp.asarray(logits), jnp.asarray(nxt)))
    x = logits.astype(np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, nxt[..., None], -1)[..., 0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_form_events_worked_example():
    # Note §2: boundaries [3, 50, 52, 300, 590] over 600 tokens -> blocks [50, 128, 122, 128, 128, 34].
    divide = np.zeros(600, bool)
    divide[[3, 50, 52, 300, 590]] = True
    assert form_events(divide, 8, 128) == [50, 128, 122, 128, 128, 34]


@pytest.mark.parametrize("seed", range(6))
def test_form_events_matches_reference_on_random_flags(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    divide = rng.random(n) < rng.choice([0.0, 0.02, 0.1, 0.4])
    for min_size, max_size in [(8, 128), (4, 16), (1, 8), (8, 8)]:
        got = form_events(divide, min_size, max_size)
        assert got == reference_form_events(list(divide), min_size, max_size)
        assert all(min(min_size, n) <= s <= max_size for s in got)
        assert sum(got) <= n


def test_threshold_window_and_statistics():
    assert threshold_window(512, 512, 4096, 128) == (0, 128)          # first chunk: its first n_init tokens
    assert threshold_window(1024, 512, 4096, 128) == (0, 512)         # second chunk
    assert threshold_window(100 + 4096 + 512, 512, 4096, 128) == (612, 4196)   # n_local - chunk tokens before
    vals = np.random.default_rng(1).gamma(2.0, 1.5, 50)
    assert surprise_threshold(vals, 1.0) == pytest.approx(vals.mean() + np.std(vals, ddof=1), rel=1e-12)
    assert surprise_threshold(vals[:1], 1.0) == float("inf")
    assert list(np.flatnonzero(uniform_flags(70, 32))) == [0, 32, 64]


def _spiky_surprise(rng, n):
    s = rng.gamma(2.0, 1.0, n)
    spikes = rng.random(n) < 0.06
    s[spikes] += rng.uniform(4, 10, spikes.sum())
    return s.astype(np.float32)


@pytest.mark.parametrize("n_init,n_local,chunk,gamma,min_size,max_size", [
    (16, 128, 64, 1.0, 8, 32),
    (128, 256, 64, 1.0, 8, 128),   # n_init > chunk: first windows come from the chunks themselves
    (0, 96, 32, 0.5, 4, 16),
    (8, 64, 64, 2.0, 8, 8),        # min == max
])
def test_segmenter_matches_reference_stream(n_init, n_local, chunk, gamma, min_size, max_size):
    rng = np.random.default_rng(n_local + chunk)
    surprise = _spiky_surprise(rng, 1500)
    cfg = EMLLMConfig(n_init=n_init, n_local=n_local, n_mem=max(256, max_size), chunk_size=chunk,
                      surprise_gamma=gamma, min_block_size=min_size, max_block_size=max_size)
    got, init_len = run_segmenter(cfg, surprise)
    want, want_init = reference_stream_events(surprise, chunk, n_local, n_init, gamma, min_size, max_size)
    assert init_len == want_init == n_init
    assert got == want
    assert len(got) > 10
    # Events tile the stream after the init tokens, each within [min, max].
    starts = [s for s, _ in got]
    assert starts[0] == n_init and all(a + n == b for (a, n), b in zip(got[:-1], starts[1:]))
    assert all(min_size <= n <= max_size for _, n in got)


def test_higher_gamma_gives_fewer_boundaries():
    surprise = _spiky_surprise(np.random.default_rng(3), 2000)
    counts = []
    for gamma in (0.0, 1.0, 3.0):
        cfg = EMLLMConfig(n_init=16, n_local=128, n_mem=512, chunk_size=64, surprise_gamma=gamma,
                          min_block_size=1, max_block_size=512)
        events, _ = run_segmenter(cfg, surprise)
        counts.append(len(events))
    assert counts[0] > counts[1] > counts[2]


@pytest.mark.parametrize("changes,field", [
    (dict(surprise_gamma=-0.5), "surprise_gamma"),
    (dict(min_block_size=64, max_block_size=32), "min_block_size"),
    (dict(n_mem=16, max_block_size=32), "n_mem"),
    (dict(chunk_size=512, n_local=256), "chunk_size"),
    (dict(refinement="louvain"), "refinement"),
    (dict(positions="alibi"), "positions"),
    (dict(max_cached_events=2), "max_cached_events"),
])
def test_bad_config_errors(changes, field):
    with pytest.raises(ValueError, match=field):
        EMLLMConfig(**changes)


def test_unknown_yaml_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("em_llm:\n  n_local: 128\n  n_locl: 4\n")
    with pytest.raises(ValueError, match="n_locl"):
        EMLLMConfig.from_yaml(path)
