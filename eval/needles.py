"""`python eval/needles.py ARGS` = `rag-jax eval needles ARGS` (rag_jax/recipes/needles/needles.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["eval", "needles", *sys.argv[1:]]))
