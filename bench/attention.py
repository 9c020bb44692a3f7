"""`rag-jax bench attention`: see rag_jax/benchmarks/attention.py."""
from rag_jax.benchmarks.attention import main

raise SystemExit(main())
