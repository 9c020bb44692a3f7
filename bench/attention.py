"""`python bench/attention.py ARGS` = `rag-jax bench attention ARGS` (rag_jax/benchmarks/attention.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "attention", *sys.argv[1:]]))
