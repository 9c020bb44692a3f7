"""EM-LLM boundary refinement: O(w²) prefix-sum scores vs brute-force evaluation of the reference metrics at every
candidate boundary (float64), and the refinement loop vs a brute-force transcription (note em_llm.md §3)."""
import jax.numpy as jnp
import numpy as np
import pytest

from rag_jax.memory import conductance_scores, key_similarity, modularity_scores, refine_boundaries


def brute_modularity(a, communities):
    """Reference ``similarity.modularity`` on explicit communities (float64)."""
    m = a.sum() / 2
    k_i, k_j = a.sum(axis=0), a.sum(axis=1)
    expected = np.outer(k_i, k_j) / (2 * m)
    q = sum((a[np.ix_(c, c)] - expected[np.ix_(c, c)]).sum() for c in communities)
    return q / (4 * m)


def brute_conductance(a, communities):
    """Reference ``similarity.conductance`` (min over communities), float64."""
    total, values = a.sum(), []
    for c in communities:
        bar = [i for i in range(a.shape[0]) if i not in c]
        cut = a[np.ix_(c, bar)].sum()
        vol = a[np.ix_(c, c)].sum()
        min_vol = min(vol, total - vol)
        values.append(cut / (1e-15 if min_vol == 0 else min_vol))
    return min(values)


def brute_scores(a, metric, first, last):
    fn = brute_modularity if metric == "modularity" else brute_conductance
    w = a.shape[0]
    return np.array([fn(a, [list(range(0, t)), list(range(t, w))]) for t in range(first, last)])


def brute_refine(boundaries, a, metric, min_size, offset):
    """Reference ``events_with_similarity_adjustment`` with the brute-force metric at every candidate."""
    base = [b + offset for b in boundaries]
    kept = [base[0]] if base[0] >= min_size or offset == 0 else []
    kept += [base[i] for i in range(1, len(base)) if base[i] - base[i - 1] >= min_size]
    out = [0]
    for event in kept:
        if event - out[-1] > min_size:
            if event - offset > min_size:
                half = int((event - out[-1]) / 2)
                lo, hi = max(0, out[-1] - half), min(a.shape[0], event + half)
                first = max(offset - lo, out[-1] - lo)
                scores = brute_scores(a[lo:hi, lo:hi], metric, first, event - lo)[min_size:]
                pick = np.argmin(scores) if metric == "conductance" else np.argmax(scores)
                out.append(lo + first + min_size + int(pick))
            else:
                out.append(event)
        elif event - out[-1] == min_size or offset == 0:
            out.append(event)
        else:
            raise AssertionError("unreachable for sorted boundaries")
    return [e - offset for e in out[1:]]


def random_graph(rng, n, layers=3, heads=2, d=8, topics=4):
    """Keys drawn around a few topic centres, contiguous in time, so modularity has real structure."""
    centres = rng.normal(size=(topics, layers, heads, d))
    topic = np.sort(rng.integers(0, topics, n))
    keys = centres[topic] + 0.7 * rng.normal(size=(n, layers, heads, d))
    keys = keys.transpose(1, 0, 2, 3).astype(np.float32)    # [layers, n, heads, d]
    return keys, np.einsum("lthd,luhd->tu", keys.astype(np.float64), keys.astype(np.float64))


def test_key_similarity_sums_layers_and_heads():
    keys, want = random_graph(np.random.default_rng(0), 40)
    got = np.asarray(key_similarity(jnp.asarray(keys)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    assert (want < 0).any()   # unnormalised, may be negative (not clipped), as the reference


@pytest.mark.parametrize("seed", range(3))
def test_scores_equal_brute_force_at_every_split(seed):
    rng = np.random.default_rng(seed)
    _, a = random_graph(rng, 37)
    asym = a + 0.3 * rng.normal(size=a.shape)   # the formulas must not rely on symmetry
    for graph in (a, asym):
        np.testing.assert_allclose(modularity_scores(graph)[1:-1], brute_scores(graph, "modularity", 1, 37),
                                   rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(conductance_scores(graph)[1:-1], brute_scores(graph, "conductance", 1, 37),
                                   rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("metric", ["modularity", "conductance"])
@pytest.mark.parametrize("seed", range(4))
def test_refine_equals_brute_force(metric, seed):
    rng = np.random.default_rng(10 + seed)
    min_size = 4
    for offset in (0, 13):
        chunk = 90
        _, a = random_graph(rng, offset + chunk)
        boundaries = np.sort(rng.choice(np.arange(1, chunk), size=int(rng.integers(1, 12)), replace=False))
        got = refine_boundaries(boundaries, a, metric, min_size, offset)
        want = brute_refine(list(boundaries), a, metric, min_size, offset)
        assert got == want
        assert all(0 <= b < chunk for b in got)
        assert got != list(boundaries) or len(got) < 3   # refinement actually moves boundaries


def test_refinement_recovers_planted_topic_boundary():
    rng = np.random.default_rng(7)
    centres = rng.normal(size=(2, 1, 1, 16)) * 2
    topic = np.array([0] * 30 + [1] * 30)
    keys = (centres[topic] + 0.3 * rng.normal(size=(60, 1, 1, 16))).transpose(1, 0, 2, 3)
    a = np.einsum("lthd,luhd->tu", keys, keys)
    # A surprise boundary placed 8 tokens late moves back to the true topic change at 30.
    assert refine_boundaries([38], a, "modularity", 4) == [30]
    assert refine_boundaries([38], a, "conductance", 4) == [30]


def test_unknown_metric():
    with pytest.raises(ValueError, match="metric"):
        refine_boundaries([10], np.eye(20), "pagerank", 4)
