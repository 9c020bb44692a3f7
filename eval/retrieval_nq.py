"""`rag-jax eval retrieval_nq`: see rag_jax/evaluation/retrieval_nq.py."""
from rag_jax.evaluation.retrieval_nq import main

raise SystemExit(main())
