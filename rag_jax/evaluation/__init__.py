"""The evaluation library: what every experiment measures with, and the evaluations that train nothing.

Helpers: ``rag`` (answer scoring, greedy answers, retrieval metrics, TTFT curves), ``models`` (``--model``
resolution), ``stats`` (paired tests), ``timing``, ``tables``, ``plots``. Evaluations (``rag-jax eval NAME``,
each a ``main(argv) -> int``): ``rag_qa``, ``retrieval_nq``, ``retrieval_recall``. Imports nothing from
``rag_jax.train`` or ``rag_jax.recipes``; each paper's experiments live in its recipe (``rag_jax/recipes/``).
"""
