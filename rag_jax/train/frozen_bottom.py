"""Training the top layers of a pretrained model from its frozen bottom's cached output.

When only the top ``k`` of ``L`` decoder layers are trained (a CPU budget; ``optimizer.trainable``), the
output of the frozen lower ``L - k`` layers for a given input never changes during training. It is computed
once per distinct input (``Transformer.residual`` of the bottom model) and kept; the train step runs a
``k``-layer ``Transformer`` (the top layers, the final norm, and the embedding as the tied output head) on
it as ``inputs_embeds``. Values are those of the full model (``tests/test_frozen_bottom.py``); a step costs
``k / L`` of a full forward and backward, and inputs seen in several steps or by several trained models
(GRIT unified vs embedding-only) share one bottom pass. The embedding feeds the bottom, so it must stay
frozen even where the tied output head uses it: ``TOP_TRAINABLE`` excludes it.

    bottom, top = split_model(model, k)        # Transformers of layers [0, L-k) and [L-k, L)
    frozen = FrozenBottom(bottom)
    frozen.precompute("bidirectional", rows)   # rows: int32 token ids, any lengths
    x = frozen.inputs_embeds("bidirectional", tokens, attention_mask)   # [B, S, hidden] for top(...)
    tuned = merge_top(model, trained_top_params)          # the full model with the trained top
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rag_jax.inference.kv_store import WeightsWatch
from rag_jax.model.embedding import pad_length
from rag_jax.model.transformer import Transformer, to_scanned, to_unrolled
from rag_jax.progress import progress_bar


def _sub_model(model: Transformer, layers: Sequence[int]) -> Transformer:
    """A ``Transformer`` of ``model``'s ``layers`` (renumbered from 0, with their windows), embedding, final
    norm and head; the arrays are shared, not copied."""
    cfg = model.config
    types = cfg.layer_types and tuple(cfg.layer_types[j] for j in layers)
    sub = cfg.replace(num_layers=len(layers), layer_types=types)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(sub, rngs=nnx.Rngs(0),
                                                                   remat_policy=model.remat_policy)))
    full = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    nnx.replace_by_pure_dict(state, {**full, "layers": {i: full["layers"][j] for i, j in enumerate(layers)}})
    return nnx.merge(graphdef, state)


def split_model(model: Transformer, top_layers: int) -> tuple[Transformer, Transformer]:
    """``(bottom, top)``: Transformers of layers ``[0, L - top_layers)`` and ``[L - top_layers, L)``.

    ``top(tokens, ..., inputs_embeds=bottom.residual(tokens, ...))`` equals ``model(tokens, ...)`` (same mode
    in both). Raises ValueError unless ``1 <= top_layers < L``."""
    n = model.config.num_layers
    if not 1 <= top_layers < n:
        raise ValueError(f"top_layers={top_layers} must be in [1, num_layers={n}) (a frozen bottom and a trained top)")
    model = to_unrolled(model)  # the parts are unrolled models (a scanned model is copied once)
    return _sub_model(model, range(n - top_layers)), _sub_model(model, range(n - top_layers, n))


# ``optimizer.trainable`` of a top model: its layers, final norm and (untied) output head; never the embedding,
# which is the frozen bottom's input (a tied output head would otherwise train it).
TOP_TRAINABLE = r"^(layers/|final_norm/|lm_head)"


def merge_top(model: Transformer, top_params: nnx.State) -> Transformer:
    """A new full model: ``model`` with its last layers, final norm and output head taken from ``top_params``
    (a ``split_model`` top's parameters, e.g. trained); the embedding and lower layers stay ``model``'s (arrays
    shared; ``model`` itself is not changed).

    Raises:
      ValueError: the top has no layers or as many as the full model.
    """
    if model.config.scan_layers:
        return to_scanned(merge_top(to_unrolled(model), top_params))
    full, top = nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.to_pure_dict(top_params)
    n, k = len(full["layers"]), len(top["layers"])
    if not 1 <= k < n:
        raise ValueError(f"top model has {k} layers; it must have 1..{n - 1} (the full model has {n})")
    params = {**full, "layers": {**full["layers"], **{n - k + i: top["layers"][i] for i in range(k)}},
              "final_norm": top["final_norm"]}
    if "lm_head" in top:
        params["lm_head"] = top["lm_head"]
    graphdef, state = nnx.split(model)  # model's own graphdef: jitted functions keyed by it are reused
    state = jax.tree.map(lambda x: x, state)  # a new State: filling it leaves model's untouched
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


@functools.partial(jax.jit, static_argnames=("graphdef", "mode"))
def _residual(graphdef, state, tokens, segment_ids, mode):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return nnx.merge(graphdef, state).residual(tokens, positions, segment_ids, mode=mode).astype(jnp.float32)


def _key(mode: str, ids: np.ndarray) -> tuple[str, bytes]:
    return mode, np.asarray(ids, np.int32).tobytes()


class FrozenBottom:
    """The bottom's output (float32 ``[len, hidden]``) for every distinct ``(mode, token ids)``, computed once.

    Inputs are right-padded rows with positions ``0..len-1`` (as ``rag_jax.model.embedding.encode`` and the GRIT
    generative rows); padding never changes a row's values (the masks exclude it).

    Args:
      bottom: the ``split_model`` bottom.
      batch_tokens: padded tokens per forward (rows per batch = this / padded length, at least 1).
      fingerprint: identifies the bottom (model and split) in saved files; ``load`` refuses another one.

    The table holds features of the bottom's weights when they were computed: if the bottom's weights are
    changed in place (``nnx.update``), the table is emptied (``WeightsWatch``) and rows must be precomputed
    again; ``features`` then raises KeyError rather than serving stale rows.
    """

    def __init__(self, bottom: Transformer, *, batch_tokens: int = 4096, fingerprint: str = ""):
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens={batch_tokens} must be >= 1")

        self._graphdef, self._state = nnx.split(bottom)
        self._weights = WeightsWatch(self._state)
        self.hidden_size = bottom.config.hidden_size
        self.batch_tokens, self.fingerprint = batch_tokens, fingerprint
        self._table: dict[tuple[str, bytes], np.ndarray] = {}

    def __len__(self) -> int:
        self._drop_if_stale()
        return len(self._table)

    def _drop_if_stale(self) -> None:
        if self._weights.changed():
            self._table.clear()
            self._weights.refresh()

    def precompute(self, mode: str, rows: Sequence[np.ndarray], *, desc: str = "frozen bottom",
                   progress: bool = True) -> None:
        """Run the bottom on the rows not yet in the table (in length order, padded to power-of-two lengths)."""
        self._drop_if_stale()
        todo = {}
        for ids in rows:
            ids = np.asarray(ids, np.int32)
            if ids.ndim != 1 or not len(ids):
                raise ValueError(f"a row must be a non-empty 1-D array of token ids; got shape {ids.shape}")
            if _key(mode, ids) not in self._table:
                todo[_key(mode, ids)] = ids
        order = sorted(todo.values(), key=len)
        with progress_bar(enabled=progress, total=len(order), desc=desc, unit="row") as bar:
            start = 0
            while start < len(order):
                width = pad_length(len(order[start]))
                chunk = [r for r in order[start:start + max(1, self.batch_tokens // width)] if len(r) <= width]
                height = pad_length(len(chunk), 1)
                tokens, seg = np.zeros((height, width), np.int32), np.zeros((height, width), np.int32)
                for i, r in enumerate(chunk):
                    tokens[i, :len(r)], seg[i, :len(r)] = r, 1
                out = np.asarray(_residual(self._graphdef, self._state, tokens, seg, mode))
                for i, r in enumerate(chunk):
                    self._table[_key(mode, r)] = out[i, :len(r)]
                start += len(chunk)
                bar.update(len(chunk))

    def features(self, mode: str, ids: np.ndarray) -> np.ndarray:
        """float32 ``[len(ids), hidden]``. Raises KeyError naming the row when it was not precomputed (or the
        bottom's weights changed since)."""
        self._drop_if_stale()
        try:
            return self._table[_key(mode, ids)]
        except KeyError:
            raise KeyError(f"no frozen-bottom features for a {mode} row of {len(ids)} tokens "
                           f"(starting {np.asarray(ids)[:8].tolist()}); precompute it first") from None

    def inputs_embeds(self, mode: str, tokens: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """float32 ``[B, S, hidden]`` for right-padded ``tokens``/``attention_mask`` ``[B, S]`` (zeros on padding
        and on all-padding rows)."""
        out = np.zeros((*tokens.shape, self.hidden_size), np.float32)
        for i, (row, mask) in enumerate(zip(tokens, attention_mask)):
            n = int(np.sum(mask))
            if n:
                out[i, :n] = self.features(mode, row[:n])
        return out

    def save(self, path: str | Path) -> None:
        """Write the table to an ``.npz`` (atomically: a temporary file renamed)."""
        self._drop_if_stale()
        keys = list(self._table)
        arrays = {"fingerprint": np.asarray(self.fingerprint), "modes": np.asarray([m for m, _ in keys]),
                  "lengths": np.asarray([len(self._table[k]) for k in keys], np.int64),
                  "ids": np.concatenate([np.frombuffer(b, np.int32) for _, b in keys]) if keys else np.zeros(0, np.int32),
                  "features": (np.concatenate([self._table[k] for k in keys]) if keys
                               else np.zeros((0, self.hidden_size), np.float32))}
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(path)

    def load(self, path: str | Path) -> None:
        """Add the rows of a ``save``d file. Raises ValueError when it was written for another fingerprint."""
        with np.load(path) as f:
            if str(f["fingerprint"]) != self.fingerprint:
                raise ValueError(f"{path} holds features of {str(f['fingerprint'])!r}, not {self.fingerprint!r}; "
                                 "delete it or use another cache path")
            ends = np.cumsum(f["lengths"])
            ids, feats = f["ids"], f["features"]
            for mode, end, n in zip(f["modes"], ends, f["lengths"]):
                self._table[(str(mode), ids[end - n:end].tobytes())] = feats[end - n:end]

