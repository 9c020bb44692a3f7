"""`python eval/long_context.py ARGS` = `rag-jax eval long_context ARGS` (rag_jax/recipes/em_llm/long_context.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["eval", "long_context", *sys.argv[1:]]))
