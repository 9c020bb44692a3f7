"""`python eval/rapid.py ARGS` = `rag-jax eval rapid ARGS` (rag_jax/recipes/rapid/rapid.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["eval", "rapid", *sys.argv[1:]]))
