"""`python bench/train_bench.py ARGS` = `rag-jax bench train_bench ARGS` (rag_jax/benchmarks/train_bench.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "train_bench", *sys.argv[1:]]))
