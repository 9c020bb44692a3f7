"""`rag-jax eval block_distill`: see rag_jax/evaluation/block_distill.py."""
from rag_jax.evaluation.block_distill import main

raise SystemExit(main())
