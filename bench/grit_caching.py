"""`python bench/grit_caching.py ARGS` = `rag-jax bench grit_caching ARGS` (rag_jax/benchmarks/grit_caching.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "grit_caching", *sys.argv[1:]]))
