"""`python bench/magicpig.py ARGS` = `rag-jax bench magicpig ARGS` (rag_jax/benchmarks/magicpig.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "magicpig", *sys.argv[1:]]))
