"""The one progress bar: ``tqdm`` on a terminal, a plain line a minute in a log.

On a terminal (stderr, or the ``file`` given, is a TTY) it is tqdm's usual bar. Written to a log file or a pipe, a
bar that runs under ``LOG_INTERVAL_S`` seconds writes nothing, and a longer one writes one full line (no carriage
returns) every ``LOG_INTERVAL_S`` seconds and one when it ends: a job in the background shows where it is
(``tail`` its log) without filling the log with updates.
"""
from __future__ import annotations

import io
import sys

from tqdm.auto import tqdm

LOG_INTERVAL_S = 60.0


class _Lines(io.TextIOBase):
    """A text stream that turns tqdm's carriage-return refreshes into whole lines (repeats dropped)."""

    def __init__(self, stream):
        self.stream, self.last = stream, None

    def write(self, text: str) -> int:
        line = text.replace("\r", "").strip()
        if line and line != self.last:
            self.stream.write(line + "\n")
            self.stream.flush()
            self.last = line
        return len(text)

    def flush(self):
        self.stream.flush()


def progress_bar(iterable=None, *, enabled: bool = True, **kwargs) -> tqdm:
    """``tqdm(iterable, **kwargs)``; off when ``enabled`` is False; a line a minute when its stream (``file``,
    default stderr) is not a terminal."""
    if not enabled:
        return tqdm(iterable, disable=True, **kwargs)
    stream = kwargs.pop("file", None) or sys.stderr
    if getattr(stream, "isatty", lambda: False)():
        return tqdm(iterable, file=stream, **kwargs)
    return tqdm(iterable, file=_Lines(stream), delay=LOG_INTERVAL_S, mininterval=LOG_INTERVAL_S,
                maxinterval=LOG_INTERVAL_S, ascii=True, **kwargs)
