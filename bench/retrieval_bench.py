"""`rag-jax bench retrieval_bench`: see rag_jax/benchmarks/retrieval_bench.py."""
from rag_jax.benchmarks.retrieval_bench import main

raise SystemExit(main())
