import sys

from rag_jax.cli import main

sys.exit(main())
