from rag_jax.cli import entry

entry()
