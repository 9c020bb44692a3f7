"""Shared evaluation code: RAG answers, retrieval and TTFT (``rag``), timing (``timing``), tables (``tables``).

The scripts under ``eval/`` and ``bench/`` are thin entry points over modules here and in
``rag_jax.evaluation.scripts`` / ``rag_jax.evaluation.benchmarks``.
"""
