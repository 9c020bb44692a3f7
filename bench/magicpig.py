"""`rag-jax bench magicpig`: see rag_jax/benchmarks/magicpig.py."""
from rag_jax.benchmarks.magicpig import main

raise SystemExit(main())
