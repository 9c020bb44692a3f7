"""`python bench/model_vs_torch.py ARGS` = `rag-jax bench model_vs_torch ARGS` (rag_jax/benchmarks/model_vs_torch.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "model_vs_torch", *sys.argv[1:]]))
