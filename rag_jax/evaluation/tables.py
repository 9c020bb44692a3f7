"""One table printer for every report, evaluation and benchmark (``tabulate``, GitHub-markdown layout so
tables paste into notes and issues as they are)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tabulate import tabulate


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, floatfmt: str | Sequence[str] = ".3f") -> str:
    """``rows`` under ``headers`` as a markdown table; floats with ``floatfmt`` (default 3 decimals), one format
    for all columns or one per column (e.g. ``",.0f"`` for thousands separators). Strings that read as numbers
    are formatted as numbers too."""
    return tabulate([list(r) for r in rows], headers=list(headers), tablefmt="github", floatfmt=floatfmt)
