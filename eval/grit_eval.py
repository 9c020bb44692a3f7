"""`rag-jax eval grit_eval`: see rag_jax/evaluation/grit_eval.py."""
from rag_jax.evaluation.grit_eval import main

raise SystemExit(main())
