"""`rag-jax bench grit_caching`: see rag_jax/benchmarks/grit_caching.py."""
from rag_jax.benchmarks.grit_caching import main

raise SystemExit(main())
