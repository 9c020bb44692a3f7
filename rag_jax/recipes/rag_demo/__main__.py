"""``python -m rag_jax.recipes.rag_demo ...`` = ``rag-jax demo ...`` (the CLI parses the arguments)."""
import sys

from rag_jax.cli import main

raise SystemExit(main(["demo", *sys.argv[1:]]))
