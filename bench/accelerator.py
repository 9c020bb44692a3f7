"""`rag-jax bench accelerator`: see rag_jax/benchmarks/accelerator.py."""
from rag_jax.benchmarks.accelerator import main

raise SystemExit(main())
