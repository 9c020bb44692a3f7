"""`python eval/rag_qa.py ARGS` = `rag-jax eval rag_qa ARGS` (rag_jax/evaluation/rag_qa.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["eval", "rag_qa", *sys.argv[1:]]))
