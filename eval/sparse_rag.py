"""`python eval/sparse_rag.py ARGS` = `rag-jax eval sparse_rag ARGS` (rag_jax/recipes/sparse_rag/sparse_rag.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["eval", "sparse_rag", *sys.argv[1:]]))
