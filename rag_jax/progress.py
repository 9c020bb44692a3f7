"""The one progress bar: ``tqdm`` shown only when asked for *and* its stream is a terminal.

``disable=None`` is tqdm's own rule for that (it disables itself when the stream is not a TTY), so a
command whose output goes to a log file or a pipe writes no carriage-return updates into it.
"""
from __future__ import annotations

from tqdm.auto import tqdm


def progress_bar(iterable=None, *, enabled: bool = True, **kwargs) -> tqdm:
    """``tqdm(iterable, **kwargs)``, off when ``enabled`` is False or stderr is not a terminal."""
    return tqdm(iterable, disable=None if enabled else True, **kwargs)
