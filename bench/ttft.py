"""`rag-jax bench ttft`: see rag_jax/benchmarks/ttft.py."""
from rag_jax.benchmarks.ttft import main

raise SystemExit(main())
