"""`python eval/grit_pretrained.py ARGS` = `rag-jax eval grit_pretrained ARGS` (rag_jax/recipes/grit/grit_pretrained.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["eval", "grit_pretrained", *sys.argv[1:]]))
