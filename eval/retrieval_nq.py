"""`python eval/retrieval_nq.py ARGS` = `rag-jax eval retrieval_nq ARGS` (rag_jax/evaluation/retrieval_nq.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["eval", "retrieval_nq", *sys.argv[1:]]))
