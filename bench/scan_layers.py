"""`rag-jax bench scan_layers`: see rag_jax/benchmarks/scan_layers.py."""
from rag_jax.benchmarks.scan_layers import main

raise SystemExit(main())
