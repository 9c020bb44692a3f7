"""`python eval/grit_eval.py ARGS` = `rag-jax eval grit_eval ARGS` (rag_jax/recipes/grit/grit_eval.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["eval", "grit_eval", *sys.argv[1:]]))
