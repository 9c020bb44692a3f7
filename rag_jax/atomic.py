"""Atomic folder writes: a folder is written under a temporary name next to its destination and renamed
into place, so a killed writer leaves the previous folder (or nothing), never a half-written one."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replace_directory(path: str | os.PathLike) -> Iterator[Path]:
    """``with replace_directory(p) as tmp: <write files into tmp>``; on a clean exit ``tmp`` replaces ``p``
    (an existing ``p`` is moved aside, then removed). On an exception ``tmp`` is removed and ``p`` kept."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes 0700 folders
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same folder and ``os.replace``:
    readers see the old file or the new one, never a part."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
