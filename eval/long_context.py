"""`rag-jax eval long_context`: see rag_jax/evaluation/long_context.py."""
from rag_jax.evaluation.long_context import main

raise SystemExit(main())
