"""`python bench/em_llm_bench.py ARGS` = `rag-jax bench em_llm_bench ARGS` (rag_jax/benchmarks/em_llm_bench.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "em_llm_bench", *sys.argv[1:]]))
