"""Atomic outputs: write under a temporary name in the same folder, then ``os.replace``.

A partial file or folder never carries the final name, so an interrupted run never counts as
complete. What is renamed into place carries the permissions of the user's umask (group- and
world-readable under the usual 022), like any other tool's output: safetensors >= 0.8 writes
through a ``tempfile`` that is always created 0600 (safetensors#764, #782), and so do
``save_file`` and every ``save_pretrained`` that uses it.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

from zgcore.hashing import canonical


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it; restored at once
    os.umask(mask)
    return mask


def umask_permissions(path: Path) -> None:
    """Give ``path`` (a file, or a folder and everything in it) the mode a plain ``open``/``mkdir``
    would: ``0o666 & ~umask`` for files, ``0o777 & ~umask`` for folders. Links are left alone."""
    mask = _umask()
    for p in [path, *(path.rglob("*") if path.is_dir() else ())]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def tmp_sibling(path: Path) -> Path:
    """A unique temporary path beside ``path`` (same filesystem, so rename is atomic)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path; on success rename it to ``path``, on error remove it.

    Works for files and folders; the result gets the umask's permissions (:func:`umask_permissions`).
    Raises ``FileExistsError`` if ``path`` is a non-empty folder created meanwhile by someone else
    (the other writer wins; nothing is overwritten).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_sibling(path)
    try:
        yield tmp
        if path.is_dir() and tmp.is_dir():
            raise FileExistsError(f"{path} was completed by another writer")
        if tmp.exists():
            umask_permissions(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented, canonical JSON to ``path`` atomically (NaN/inf become ``null``)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(canonical(obj, nonfinite="null"), indent=2, sort_keys=True) + "\n")


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
