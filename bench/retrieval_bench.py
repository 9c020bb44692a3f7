"""`python bench/retrieval_bench.py ARGS` = `rag-jax bench retrieval_bench ARGS` (rag_jax/benchmarks/retrieval_bench.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "retrieval_bench", *sys.argv[1:]]))
