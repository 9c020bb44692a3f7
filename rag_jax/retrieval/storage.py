"""Atomic, verified directories for indexes and corpora.

``atomic_directory(path, fmt, meta)`` yields a temporary sibling directory; when the block exits
without error it writes ``manifest.json`` (format name, version, caller metadata, and every file's
size and CRC-32) and swaps the directory into ``path``. ``path`` therefore always holds either the
old complete directory or the new complete one, never a half-written one. ``read_manifest`` checks a
directory against its manifest before any file is handed to a parser (a truncated or altered ScaNN
asset can abort the process inside ScaNN's C++ code; research note retrieval_eval.md §1, #1223/#1322).
Paths inside are relative, so a directory can be moved or copied as a whole.
"""
from __future__ import annotations

import contextlib
import json
import os
import zlib
from pathlib import Path

from rag_jax.atomic import MARKER, recover, replace_directory

MANIFEST = "manifest.json"
_CRC_BLOCK = 1 << 24  # bytes read per step when checksumming


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_CRC_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def _file_table(root: Path) -> dict[str, dict[str, int]]:
    table = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name not in (MANIFEST, MARKER):
            table[p.relative_to(root).as_posix()] = {"bytes": p.stat().st_size, "crc32": _crc32(p)}
    return table


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, fmt: str, meta: dict, version: int = 1, *, overwrite: bool = False):
    """Write a directory atomically: ``with atomic_directory(p, "rag_jax.x", meta) as tmp: <write into tmp>``.

    ``meta`` is read when the block exits, so the block may still fill it in. The swap, the recovery of
    interrupted swaps and the refusal rules are ``rag_jax.atomic.replace_directory``'s, with ``fmt`` as
    the artifact kind.

    Raises:
      rag_jax.atomic.TargetExistsError (a ValueError): ``path`` is a file, holds files rag_jax did not write, or holds another format
        (unless ``overwrite``) — it is never replaced then.
    """
    with replace_directory(path, fmt, overwrite=overwrite) as tmp:
        yield tmp
        manifest = {"format": fmt, "version": version, "meta": meta, "files": _file_table(tmp)}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())


def read_manifest(path: str | os.PathLike, fmt: str, *, max_version: int = 1, verify: bool = True) -> dict:
    """Check ``path`` against its manifest and return the manifest's ``meta``.

    Raises:
      FileNotFoundError: ``path`` is not a directory.
      ValueError: no/corrupt ``manifest.json``, another format or a newer version, or a file missing,
        of the wrong size or (with ``verify``) the wrong CRC-32. The message names the file.
    """
    path = Path(path)
    recover(path)
    if not path.is_dir():
        raise FileNotFoundError(f"index/corpus directory {path} does not exist")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} has no {MANIFEST}; it is not a complete rag_jax {fmt} directory "
                         "(interrupted write or a different tool)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / MANIFEST} is corrupt ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise ValueError(f"{path} holds format {got!r}; expected {fmt!r}")
    if not isinstance(manifest.get("version"), int) or manifest["version"] > max_version:
        raise ValueError(f"{path} has {fmt} version {manifest.get('version')!r}; this code reads up to "
                         f"version {max_version}")
    for rel, info in manifest.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            raise ValueError(f"corrupt directory {path}: file {rel} listed in {MANIFEST} is missing")
        if f.stat().st_size != info["bytes"]:
            raise ValueError(f"corrupt directory {path}: file {rel} has {f.stat().st_size} bytes, "
                             f"expected {info['bytes']}")
        if verify and _crc32(f) != info["crc32"]:
            raise ValueError(f"corrupt directory {path}: file {rel} fails its CRC-32 check")
    return manifest["meta"]
