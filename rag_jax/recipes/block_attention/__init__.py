"""Block-Attention (Ma et al., ICLR 2025): fine-tuning recipes and experiments (see rag_jax.recipes)."""
