"""Benchmarks (``rag-jax bench NAME``; thin entry points in ``bench/``): each module has ``main(argv) -> int``
and prints a table of medians and ratios against a baseline measured in the same run."""
