"""`rag-jax eval retrieval_recall`: see rag_jax/evaluation/retrieval_recall.py."""
from rag_jax.evaluation.retrieval_recall import main

raise SystemExit(main())
