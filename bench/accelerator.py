"""`python bench/accelerator.py ARGS` = `rag-jax bench accelerator ARGS` (rag_jax/benchmarks/accelerator.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "accelerator", *sys.argv[1:]]))
