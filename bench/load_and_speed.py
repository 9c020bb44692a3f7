"""`rag-jax bench load_and_speed`: see rag_jax/benchmarks/load_and_speed.py."""
from rag_jax.benchmarks.load_and_speed import main

raise SystemExit(main())
