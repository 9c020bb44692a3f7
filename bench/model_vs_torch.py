"""`rag-jax bench model_vs_torch`: see rag_jax/benchmarks/model_vs_torch.py."""
from rag_jax.benchmarks.model_vs_torch import main

raise SystemExit(main())
