"""`python eval/passkey.py ARGS` = `rag-jax eval passkey ARGS` (rag_jax/recipes/em_llm/passkey.py)."""
import sys

from rag_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["eval", "passkey", *sys.argv[1:]]))
