"""RAPID (Chen et al., ICML 2025): retrieval-augmented speculative decoding on long prompts (see rag_jax.recipes)."""
