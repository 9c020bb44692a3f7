"""`rag-jax bench em_llm_bench`: see rag_jax/benchmarks/em_llm_bench.py."""
from rag_jax.benchmarks.em_llm_bench import main

raise SystemExit(main())
