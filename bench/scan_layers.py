"""`python bench/scan_layers.py ARGS` = `rag-jax bench scan_layers ARGS` (rag_jax/benchmarks/scan_layers.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "scan_layers", *sys.argv[1:]]))
