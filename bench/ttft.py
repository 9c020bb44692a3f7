"""`python bench/ttft.py ARGS` = `rag-jax bench ttft ARGS` (rag_jax/benchmarks/ttft.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "ttft", *sys.argv[1:]]))
