"""One-line loader errors that name the file: the boundary every file loader raises through.

``naming(path)`` turns what a malformed file makes a parser raise (``ValueError``, and the ``KeyError`` /
``TypeError`` / ``IndexError`` of a field with the wrong shape or type) into ``ValueError("{path}: {reason}")``
on one line, so a user sees which file and which field, never a traceback from inside a parser.
"""
from __future__ import annotations

import contextlib
import os


def one_line(message: object, limit: int = 300) -> str:
    """``message`` with all whitespace runs as one space, cut to ``limit`` characters."""
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


@contextlib.contextmanager
def naming(path: str | os.PathLike, what: str = ""):
    """Re-raise a parse failure inside the block as a one-line ``ValueError`` naming ``path`` (and ``what``
    was being read). A ``ValueError`` that already names the file keeps its text, made one line."""
    try:
        yield
    except FileNotFoundError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, OverflowError, AttributeError, UnicodeError) as e:
        if isinstance(e, KeyError):
            reason = f"missing field {e.args[0]!r}" if e.args else "missing field"
        elif isinstance(e, ValueError):
            reason = str(e)
        else:
            reason = f"malformed field ({type(e).__name__}: {e})"
        reason = one_line(reason)
        if str(path) in reason:
            raise ValueError(reason) from None
        raise ValueError(f"{path}: {what + ': ' if what else ''}{reason}") from None
