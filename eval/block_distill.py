"""`python eval/block_distill.py ARGS` = `rag-jax eval block_distill ARGS` (rag_jax/recipes/block_attention/block_distill.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["eval", "block_distill", *sys.argv[1:]]))
