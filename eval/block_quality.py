"""`python eval/block_quality.py ARGS` = `rag-jax eval block_quality ARGS` (rag_jax/recipes/block_attention/block_quality.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["eval", "block_quality", *sys.argv[1:]]))
