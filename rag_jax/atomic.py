"""The one atomic folder writer (HF exports, demo checkpoints, indexes, corpora) and atomic file writes.

``with replace_directory(path, kind) as tmp: <write files into tmp>`` writes into a temporary sibling
``.<name>.tmp-<pid>-<hex>``; on a clean exit it adds a marker file (``MARKER``: the artifact ``kind`` and
the list of files written) and swaps the folder into ``path``. ``path`` therefore holds the previous
complete folder or the new complete one, never a half-written one.

Never removes data it did not write. An existing ``path`` is replaced only when it is empty or when its
marker (or, for folders from before markers, ``manifest.json``'s ``format``) names the same ``kind``
(``overwrite=True``: any rag_jax kind) AND every file in it is one the marker lists. A file, a folder
holding files of its own (``notes.txt``, a transformers export), or another kind of artifact is refused
with a one-line ``TargetExistsError`` (a FileExistsError and a ValueError) naming the path and what is there.

Interrupted swaps: the swap is two renames (``path`` -> ``.<name>.old-<pid>@<host>-<hex>``, then tmp -> ``path``).
``recover(path)`` (run before every write and by ``read_manifest``) finishes an interrupted swap: when
``path`` is missing it promotes the newest complete temporary folder (one holding the marker) or else
moves the old folder back; leftovers of dead writers (``.tmp-*`` / ``.old-*`` whose process is gone) are
removed. Folders of live writers (a process still running here, or any writer on another host) are left alone.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

MARKER = ".rag_jax_artifact.json"
LEGACY_MANIFEST = "manifest.json"  # rag_jax.retrieval.storage folders written before markers existed


class TargetExistsError(FileExistsError, ValueError):
    """``path`` holds something ``replace_directory`` must not replace (a FileExistsError and a ValueError)."""


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def read_marker(path: str | os.PathLike) -> dict | None:
    """``{"kind", "files"}`` of a folder written by ``replace_directory`` (or a pre-marker storage folder
    from its ``manifest.json``); None when the folder carries neither."""
    path = Path(path)
    for name, kind_key in ((MARKER, "kind"), (LEGACY_MANIFEST, "format")):
        try:
            data = json.loads((path / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get(kind_key), str):
            files = set(data.get("files") or ())
            return {"kind": data[kind_key], "files": files | {name}}
    return None


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _writer_tag() -> str:
    return f"{os.getpid()}@{socket.gethostname()}"


def _leftovers(path: Path, what: str) -> list[tuple[Path, bool]]:
    """``(folder, writer alive)`` for ``.<name>.<what>-<pid>@<host>-<hex>`` siblings of ``path``. A writer
    on another host (shared file system) counts as alive: its process cannot be checked from here."""
    out = []
    if not path.parent.is_dir():
        return out
    prefix = f".{path.name}.{what}-"
    for p in path.parent.iterdir():
        if p.name.startswith(prefix) and p.is_dir():
            pid, _, host = p.name[len(prefix):].rpartition("-")[0].partition("@")
            if host and host != socket.gethostname():
                out.append((p, True))
            else:
                out.append((p, _pid_alive(int(pid)) if pid.isdigit() else False))
    return out


def recover(path: str | os.PathLike) -> str | None:
    """Finish or undo an interrupted ``replace_directory`` swap of ``path`` and remove dead writers'
    temporary folders. Returns a one-line description of what was repaired, or None when nothing was."""
    path = Path(path).absolute()
    tmps = [p for p, alive in _leftovers(path, "tmp") if not alive]
    olds = [p for p, alive in _leftovers(path, "old") if not alive]
    done = None
    if not path.exists():
        complete = sorted((p for p in tmps if (p / MARKER).is_file()),
                          key=lambda p: (p / MARKER).stat().st_mtime)
        if complete:
            os.rename(complete[-1], path)
            tmps.remove(complete[-1])
            done = f"{path}: finished an interrupted save (promoted {complete[-1].name})"
        elif olds:
            newest = max(olds, key=lambda p: p.stat().st_mtime)
            os.rename(newest, path)
            olds.remove(newest)
            done = f"{path}: restored the previous folder after an interrupted save ({newest.name})"
    for p in tmps + olds:
        shutil.rmtree(p, ignore_errors=True)
    if tmps or olds:
        done = (done + "; " if done else f"{path}: ") + f"removed {len(tmps) + len(olds)} stale temporary folder(s)"
    if done:
        log.warning("%s", done)
    return done


def check_target(path: str | os.PathLike, kind: str, *, overwrite: bool = False) -> None:
    """Raise ``TargetExistsError`` (one line) unless ``replace_directory(path, kind)`` may replace ``path``.

    Allowed: ``path`` missing or an empty folder; or a folder whose marker names ``kind`` (any kind with
    ``overwrite=True``) and which holds only the files the marker lists.
    """
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_dir() or path.is_symlink():
        raise TargetExistsError(f"refusing to write {kind} into {path}: it exists and is not a folder; "
                              "choose another path or remove it")
    present = _files(path)
    if not present and not any(path.iterdir()):
        return
    marker = read_marker(path)
    if marker is None:
        some = ", ".join(sorted(present)[:3]) or "sub-folders"
        raise TargetExistsError(f"refusing to overwrite {path}: it holds files not written by rag_jax ({some}); "
                              "choose another path or remove it yourself")
    if marker["kind"] != kind and not overwrite:
        raise TargetExistsError(f"refusing to overwrite {path}: it holds a {marker['kind']!r} artifact, not "
                              f"{kind!r}; choose another path (or pass overwrite=True to replace it)")
    foreign = sorted(present - marker["files"])
    if foreign:
        raise TargetExistsError(f"refusing to overwrite {path}: it holds files rag_jax did not write "
                              f"({', '.join(foreign[:3])}); move them out or choose another path")


@contextlib.contextmanager
def replace_directory(path: str | os.PathLike, kind: str = "rag_jax.folder", *,
                      overwrite: bool = False) -> Iterator[Path]:
    """``with replace_directory(p, kind) as tmp: <write files into tmp>``; on a clean exit ``tmp`` (plus
    the marker) replaces ``p``. On an exception ``tmp`` is removed and ``p`` kept unchanged.

    Args:
      path: destination folder.
      kind: artifact kind recorded in the marker, e.g. ``"rag_jax.hf_model"``.
      overwrite: also replace a folder holding another rag_jax artifact kind (never foreign files).

    Raises:
      TargetExistsError: ``path`` may not be replaced (see ``check_target``); raised before the block runs.
    """
    path = Path(path).absolute()
    recover(path)
    check_target(path, kind, overwrite=overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{_writer_tag()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        files = sorted(_files(tmp))
        _write_json(tmp / MARKER, {"kind": kind, "files": files})
        check_target(path, kind, overwrite=overwrite)  # another process may have written meanwhile
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{_writer_tag()}-{uuid.uuid4().hex[:8]}"
            os.rename(path, old)
        os.rename(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (``write_bytes``)."""
    return write_bytes(path, text.encode("utf-8"))


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``: readers see the
    old file or the new one, never a part. The folder is created if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
