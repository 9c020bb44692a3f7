"""``python -m rag_jax.demo ...`` = ``rag-jax demo ...``."""
from rag_jax.demo import main

raise SystemExit(main())
