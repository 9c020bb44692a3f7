"""`python bench/load_and_speed.py ARGS` = `rag-jax bench load_and_speed ARGS` (rag_jax/benchmarks/load_and_speed.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "load_and_speed", *sys.argv[1:]]))
