"""`rag-jax bench train_bench`: see rag_jax/benchmarks/train_bench.py."""
from rag_jax.benchmarks.train_bench import main

raise SystemExit(main())
