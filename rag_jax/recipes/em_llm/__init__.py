"""EM-LLM (Fountas et al., ICLR 2025): passkey and long-context experiments (see rag_jax.recipes)."""
