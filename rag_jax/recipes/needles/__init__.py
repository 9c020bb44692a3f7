"""Artificial Needles (Xiong et al., ICLR 2025): synthetic retrieval fine-tuning and its evaluation (see rag_jax.recipes)."""
