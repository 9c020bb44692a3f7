"""Graph-theoretic boundary refinement (EM-LLM, Fountas et al., ICLR 2025, §3.2 "Boundary refinement").

The similarity graph of a chunk's tokens is ``A[t, u] = Σ_layers Σ_kv_heads <k_t, k_u>`` over the pre-RoPE
keys of layers ``refine_from_layer..L-1`` (reference ``em_llm.py``: one matrix summed over layers and KV heads,
not per head as the paper writes; unnormalised, may be negative). Each surprise boundary β, with α the
previous refined boundary, moves to the split ``t ∈ [α + min_size, β)`` of the window
``[α - s/2, β + s/2)`` (``s = β - α``) that maximises modularity or minimises conductance of the two
communities ``{[start, t), [t, end)}``. The metrics are the reference's (``similarity.py``):

- modularity ``Q = Σ_c Σ_{i,j∈c} (A_ij - k_i k_j / 2m) / 4m`` with ``k`` the column (i) and row (j) sums and
  ``2m = ΣA``;
- conductance ``min_c cut(c) / min(vol(c), ΣA - vol(c))`` with ``vol(c) = Σ_{c×c} A`` (0 replaced by 1e-15).

The reference scores every candidate by recomputing the metric on the whole window (O(w²) per candidate,
O(w³) per event). Here one 2-D prefix sum of the window scores all candidates in O(w²) per event
(research note §3, "JAX plan"); values are float64 (the reference uses the model dtype).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

METRICS = ("modularity", "conductance")


def key_similarity(keys: jnp.ndarray) -> jnp.ndarray:
    """Similarity graph of tokens from their keys.

    Args:
      keys: ``[num_layers, seq, num_kv_heads, head_dim]`` pre-RoPE keys of the selected layers.

    Returns:
      float32 ``[seq, seq]``: ``A[t, u] = Σ_l Σ_h k[l, t, h] · k[l, u, h]``.
    """
    return jnp.einsum("lthd,luhd->tu", keys, keys, preferred_element_type=jnp.float32)


def _block_sums(a: np.ndarray):
    """For every split ``t`` in ``0..w``: sums of the four blocks of ``a`` cut at ``t`` (float64 ``[w+1]`` each)."""
    w = a.shape[0]
    p = np.zeros((w + 1, w + 1))
    p[1:, 1:] = np.cumsum(np.cumsum(a, axis=0), axis=1)
    t = np.arange(w + 1)
    s11 = p[t, t]
    s12 = p[t, w] - s11
    s21 = p[w, t] - s11
    s22 = p[w, w] - s11 - s12 - s21
    return s11, s12, s21, s22


def modularity_scores(a: np.ndarray) -> np.ndarray:
    """Modularity of the split ``{[0, t), [t, w)}`` for every ``t`` in ``0..w``: float64 ``[w + 1]``."""
    a = np.asarray(a, np.float64)
    s11, _, _, s22 = _block_sums(a)
    col = np.concatenate([[0.0], np.cumsum(a.sum(axis=0))])  # Σ_{i<t} k_i (column sums)
    row = np.concatenate([[0.0], np.cumsum(a.sum(axis=1))])  # Σ_{j<t} k_j (row sums)
    total = a.sum()
    expected = (col * row + (col[-1] - col) * (row[-1] - row)) / total
    return (s11 + s22 - expected) / (2.0 * total)


def conductance_scores(a: np.ndarray) -> np.ndarray:
    """Conductance (min over the two communities) of the split ``{[0, t), [t, w)}`` for every ``t``:
    float64 ``[w + 1]``."""
    a = np.asarray(a, np.float64)
    s11, s12, s21, s22 = _block_sums(a)
    total = a.sum()

    def one(cut, vol):
        min_vol = np.minimum(vol, total - vol)
        return cut / np.where(min_vol == 0, 1e-15, min_vol)

    return np.minimum(one(s12, s11), one(s21, s22))


def split_scores(a: np.ndarray, metric: str) -> np.ndarray:
    """``modularity_scores`` or ``conductance_scores`` by name (ValueError otherwise)."""
    if metric == "modularity":
        return modularity_scores(a)
    if metric == "conductance":
        return conductance_scores(a)
    raise ValueError(f"refinement metric={metric!r}; valid: {METRICS}")


def refine_boundaries(boundaries, a: np.ndarray, metric: str, min_size: int, offset: int = 0) -> list[int]:
    """Move each surprise boundary to the best split of its neighbourhood (reference
    ``events_with_similarity_adjustment``).

    Args:
      boundaries: sorted chunk-relative indices of the surprise boundaries (``divide`` flags).
      a: ``[offset + chunk_len, offset + chunk_len]`` similarity graph; its first ``offset`` rows are the
        tokens since the previous chunk's last boundary (backward buffer).
      metric: ``"modularity"`` (argmax) or ``"conductance"`` (argmin).
      min_size: minimum event size in tokens (boundaries closer than this to the previous one are dropped
        first; candidates start ``min_size`` after the previous boundary).
      offset: backward buffer length in tokens.

    Returns:
      Refined chunk-relative boundaries (as many as survive the ``min_size`` filter).
    """
    if metric not in METRICS:
        raise ValueError(f"refinement metric={metric!r}; valid: {METRICS}")
    a = np.asarray(a, np.float64)
    base = [int(b) + offset for b in boundaries]
    if not base:
        return []
    kept = [base[0]] if base[0] >= min_size or offset == 0 else []
    # The reference compares each boundary with the previous *original* one, not the previous kept one.
    kept += [base[i] for i in range(1, len(base)) if base[i] - base[i - 1] >= min_size]
    refined = [0]
    for beta in kept:
        alpha = refined[-1]
        if beta - alpha > min_size:
            if beta - offset > min_size:
                half = (beta - alpha) // 2
                start, end = max(0, alpha - half), min(a.shape[0], beta + half)
                first = max(offset, alpha) + min_size
                scores = split_scores(a[start:end, start:end], metric)[first - start:beta - start]
                pick = np.argmin(scores) if metric == "conductance" else np.argmax(scores)
                refined.append(first + int(pick))
            else:
                refined.append(beta)
        elif beta - alpha == min_size or offset == 0:
            refined.append(beta)
        else:
            raise ValueError(f"boundary {beta - offset} is {beta - alpha} < min_size={min_size} tokens after the "
                             f"previous one; boundaries must be sorted")
    return [b - offset for b in refined[1:]]
