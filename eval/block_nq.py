"""`rag-jax eval block_nq`: see rag_jax/evaluation/block_nq.py."""
from rag_jax.evaluation.block_nq import main

raise SystemExit(main())
