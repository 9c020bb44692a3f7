"""`python eval/rag_scaling.py ARGS` = `rag-jax eval rag_scaling ARGS` (rag_jax/recipes/rag_scaling/rag_scaling.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["eval", "rag_scaling", *sys.argv[1:]]))
