"""Evaluation: shared RAG answer / retrieval / TTFT evaluation (``rag``), model resolution for ``--model``
(``models``), timing (``timing``) and tables (``tables``), and the evaluations ``rag-jax eval NAME`` runs
(``block_quality``, ``grit_eval``, ``passkey``, ``rag_qa``, ``retrieval_nq``, ``retrieval_recall``; each has
``main(argv) -> int``). The scripts under ``eval/`` and ``bench/`` are thin entry points over these modules and
``rag_jax.benchmarks``.
"""
