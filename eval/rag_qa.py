"""`rag-jax eval rag_qa`: see rag_jax/evaluation/rag_qa.py."""
from rag_jax.evaluation.rag_qa import main

raise SystemExit(main())
