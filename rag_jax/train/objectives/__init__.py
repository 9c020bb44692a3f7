"""Training objectives: pure ``loss_fn(model, batch, rng) -> (loss, metrics)`` used inside the jitted step.

``model`` is the merged NNX module (``nnx.merge(graphdef, params)`` inside jit), ``batch`` a dict of
arrays with a leading global batch axis, ``rng`` a PRNG key for stochastic objectives. ``loss`` is a
float32 scalar; ``metrics`` a dict of float32 scalars. If ``metrics["num_tokens"]`` is present the train
step weights micro-batch gradients by it under gradient accumulation, so the accumulated gradient equals
the gradient of the token-mean loss over the whole batch. A loss_fn is a static jit argument, so it
must be hashable (a function, or a frozen dataclass with ``__call__``).

Objectives: ``lm`` (next-token LM, here), ``block`` (Block-Attention fine-tuning), ``grit`` (GRIT).
"""
from rag_jax.train.objectives.lm import LMLoss, lm_loss

__all__ = ["LMLoss", "lm_loss"]
