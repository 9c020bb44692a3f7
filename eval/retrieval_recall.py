"""`python eval/retrieval_recall.py ARGS` = `rag-jax eval retrieval_recall ARGS` (rag_jax/evaluation/retrieval_recall.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["eval", "retrieval_recall", *sys.argv[1:]]))
