"""`rag-jax train` / `python -m train.train`: see rag_jax/train/cli.py."""
from rag_jax.train.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
