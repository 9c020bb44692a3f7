"""GRIT (Muennighoff et al., 2024): experiments on a trained reader and on a pretrained chat model (see rag_jax.recipes)."""
