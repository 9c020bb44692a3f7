"""`python eval/block_nq.py ARGS` = `rag-jax eval block_nq ARGS` (rag_jax/recipes/block_attention/block_nq.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["eval", "block_nq", *sys.argv[1:]]))
