"""LoRA adapters on a ``Transformer``: add them to a pretrained model, fold them back into its weights.

``ModelConfig.lora_rank`` puts a ``flax.nnx.LoRA`` beside each ``lora_targets`` projection of every layer
(Hu et al., ICLR 2022: ``y = x W + x A B``, ``W`` frozen, ``A [in, r]`` and ``B [r, out]`` trained, ``B = 0`` at
the start). Training only the adapters (``optimizer.trainable = LORA_TRAINABLE``) leaves the frozen weights'
gradients uncomputed and their optimizer state absent; the result folds back into a plain model
(``merge_lora``), which every other part of the framework reads (and ``model.delta`` ships exactly at rank
``r``, since each ``A B`` has rank at most ``r``).

    model = add_lora(base, rank=16)              # same outputs as base; adapters in model.layers[i].attn.lora_wq ...
    ...train with optimizer.trainable=LORA_TRAINABLE...
    plain = merge_lora(model)                    # W + A B, lora_rank 0: the tuned model without adapters
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rag_jax.model.config import LORA_TARGETS
from rag_jax.model.transformer import Transformer, to_scanned, to_unrolled

# ``optimizer.trainable`` (a regex over parameter paths such as ``layers/3/attn/lora_wq/lora_a``) of the adapters.
LORA_TRAINABLE = r"/lora_[a-z]+/lora_[ab]$"


def _fresh(cfg, remat_policy):
    """``(graphdef, state)`` of an abstract ``Transformer(cfg)`` (nothing allocated)."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), remat_policy=remat_policy)))


def add_lora(model: Transformer, rank: int, *, targets=LORA_TARGETS, seed: int = 0) -> Transformer:
    """A new model: ``model``'s weights with rank-``rank`` adapters on ``targets`` in every layer, ``lora_a``
    drawn as ``nnx.LoRA`` draws it (He uniform, from ``seed``), ``lora_b`` zeros, so its outputs equal
    ``model``'s. ``model`` is unchanged (arrays shared).

    Raises:
      ValueError: ``rank < 1``, unknown ``targets``, or a model that has adapters already.
    """
    cfg = model.config
    if cfg.lora_rank:
        raise ValueError(f"model already has LoRA adapters (lora_rank={cfg.lora_rank}); merge_lora first")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank={rank!r} must be an integer >= 1")
    lcfg = cfg.replace(lora_rank=rank, lora_targets=tuple(targets), scan_layers=False)   # validates targets
    graphdef, state = _fresh(lcfg, model.remat_policy)
    values = nnx.to_pure_dict(nnx.state(to_unrolled(model), nnx.Param))
    key = jax.random.key(seed)
    init = nnx.nn.lora.default_a_initializer
    for i, layer in values["layers"].items():
        for part, names in (("attn", ("wq", "wk", "wv", "wo")), ("mlp", ("gate", "up", "down"))):
            for name in names:
                if name not in lcfg.lora_targets:
                    continue
                a = state["layers"][i][part][f"lora_{name}"]
                shape_a, shape_b = a["lora_a"].get_value().shape, a["lora_b"].get_value().shape
                k = jax.random.fold_in(key, int(i) * len(LORA_TARGETS) + LORA_TARGETS.index(name))
                layer[part][f"lora_{name}"] = {"lora_a": init(k, shape_a, lcfg.weight_dtype),
                                               "lora_b": jnp.zeros(shape_b, lcfg.weight_dtype)}
    nnx.replace_by_pure_dict(state, values)
    out = nnx.merge(graphdef, state)
    return to_scanned(out) if cfg.scan_layers else out


def _fold(tree: dict) -> dict:
    """``tree`` (a pure parameter dict) with every ``lora_<name>: {lora_a, lora_b}`` folded into ``<name>``:
    ``W + A B`` reshaped to ``W``'s shape, products in float32 (stacked layers: batched over the leading axis)."""
    out = {}
    for k, v in tree.items():
        if isinstance(k, str) and k.startswith("lora_"):
            continue
        out[k] = _fold(v) if isinstance(v, dict) else v
    for k, v in tree.items():
        if isinstance(k, str) and k.startswith("lora_"):
            w = out[k[len("lora_"):]]
            product = jnp.matmul(jnp.asarray(v["lora_a"], jnp.float32), jnp.asarray(v["lora_b"], jnp.float32))
            out[k[len("lora_"):]] = (jnp.asarray(w, jnp.float32) + product.reshape(w.shape)).astype(w.dtype)
    return out


def merge_lora(model: Transformer) -> Transformer:
    """``model`` with each adapter folded into its projection (``W + A B``; ``lora_rank`` 0): a plain model of
    the same outputs (up to rounding in ``param_dtype``) that HF export, deltas and every inference path read.
    A model without adapters is returned as is."""
    cfg = model.config
    if not cfg.lora_rank:
        return model
    graphdef, state = _fresh(cfg.replace(lora_rank=0), model.remat_policy)
    nnx.replace_by_pure_dict(state, _fold(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    return nnx.merge(graphdef, state)

