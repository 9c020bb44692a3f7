"""`rag-jax eval passkey`: see rag_jax/evaluation/passkey.py."""
from rag_jax.evaluation.passkey import main

raise SystemExit(main())
