"""`rag-jax eval block_quality`: see rag_jax/evaluation/block_quality.py."""
from rag_jax.evaluation.block_quality import main

raise SystemExit(main())
