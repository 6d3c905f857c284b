"""What guards a shard file's bytes, and the whole-store check.

A read checks the bytes it uses: each sequence's bytes against the xxh3_64 its shard recorded
(:meth:`BoundaryReader.read`). Every other byte of the file (HDF5's superblock, object headers and
heaps, the ``xxh3`` column itself, the statistics rows, free space) is covered from format 5 on by
``outside_sha256``: the SHA-256 of the file with the sequence data of dataset ``h`` (one contiguous
byte range, ``data = [offset, bytes]``) left out, recorded at build time and checked when a reader
first opens the file. Opening a store and reading its first batch then costs what the metadata
and that batch's bytes cost, whatever the files' sizes (``bench/store_scale.py``).

The whole-file SHA-256 (``sha256``) is still recorded for every file, and :func:`check_store`
(the ``zerograph verify`` command) compares every byte of every shard with it.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping

import h5py

from .common import MANIFEST

CHUNK = 1 << 22  # bytes hashed per read (4 MiB)


def data_range(path: str | os.PathLike) -> tuple[int, int]:
    """``(byte offset, bytes)`` of dataset ``h``'s sequence data in an HDF5 shard file, which the
    store writes contiguous and unfiltered (format >= 4). Raises ``ValueError`` for any other
    layout (chunked, filtered, not yet allocated)."""
    with h5py.File(path, "r") as f:
        ds = f["h"]
        offset = ds.id.get_offset()
        if ds.chunks is not None or ds.id.get_create_plist().get_nfilters() or offset is None:
            raise ValueError(f"{path}: dataset h is not one contiguous, unfiltered, allocated block")
        return int(offset), int(ds.id.get_storage_size())


def _hash_ranges(path: str | os.PathLike, skip: tuple[int, int] | None, whole: bool) -> tuple[str | None, str]:
    """``(whole-file SHA-256 or None, SHA-256 of the bytes outside [skip[0], skip[0] + skip[1]))``
    in one pass; with ``whole`` False the skipped range is never read."""
    lo, n = skip if skip is not None else (0, 0)
    hi = lo + n
    h_all, h_out = hashlib.sha256(), hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while True:
            if not whole and lo <= pos < hi:
                f.seek(hi)
                pos = hi
            block = f.read(CHUNK if whole or pos >= hi else min(CHUNK, lo - pos))
            if not block:
                break
            if whole:
                h_all.update(block)
            end = pos + len(block)
            if end <= lo or pos >= hi:  # wholly outside the data
                h_out.update(block)
            else:  # straddles the data range: only its outside parts
                mv = memoryview(block)
                h_out.update(mv[: max(0, lo - pos)])
                h_out.update(mv[max(0, hi - pos):])
            pos = end
    return (h_all.hexdigest() if whole else None), h_out.hexdigest()


def outside_sha256(path: str | os.PathLike, data: tuple[int, int]) -> str:
    """SHA-256 (hex) of every byte of ``path`` outside ``data = (offset, bytes)``, which is never
    read (seeked over): the check a reader runs when it opens a format-5 shard file."""
    return _hash_ranges(path, tuple(data), whole=False)[1]


def file_record(path: str | os.PathLike) -> dict[str, Any]:
    """A shard file's entry in ``shard.json`` and the manifest (format 5): ``name``, ``bytes``,
    ``sha256`` (every byte, for :func:`check_store`), ``data`` (``[offset, bytes]`` of ``h``'s
    sequence data) and ``outside_sha256`` (every other byte, checked at open); both hashes in one
    read of the file. Raises ``ValueError`` if ``h`` is not contiguous (:func:`data_range`)."""
    path = Path(path)
    data = data_range(path)
    whole, outside = _hash_ranges(path, data, whole=True)
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": whole, "data": list(data),
            "outside_sha256": outside}


def store_shards(root: str | os.PathLike) -> list[tuple[Path, dict[str, Mapping[str, Any]]]]:
    """Every shard of the store whose join folder is ``root``: ``(shard folder, {key: file
    record})``, in the manifest's order. Raises ``OSError`` / ``ValueError`` for a missing or
    unreadable manifest."""
    root = Path(root)
    return [((root / sh["dir"]).resolve(), dict(sh["files"])) for sh in json.loads((root / MANIFEST).read_text())["shards"]]


def check_shard(folder: str | os.PathLike, files: Mapping[str, Mapping[str, Any]],
                progress: Callable[[int], None] | None = None, quarantine_damaged: bool = True) -> list[tuple[Path, str]]:
    """Check every byte of the shard files ``files`` (records as in ``shard.json``) in ``folder``
    against their whole-file SHA-256 and size.

    Args:
        progress: called with the number of bytes just hashed (e.g. a tqdm bar's ``update``).
        quarantine_damaged: move a damaged shard folder aside (``<shard>.damaged-<time>``, as
            :class:`~zgcore.data.boundary_store.BoundaryReader` does) so that the next run rebuilds
            that shard only.

    Returns:
        ``[]`` when whole, else one ``(first damaged file, what is wrong)``. A file that cannot be
        read for an I/O reason is reported and the shard kept.
    """
    from .common import quarantine

    folder = Path(folder)
    for _, e in sorted(files.items()):
        path = folder / e["name"]
        if not path.is_file() or path.stat().st_size != e["bytes"]:
            why = f"missing or not {e['bytes']} bytes (the recorded size)"
        else:
            try:
                digest = sha256_with_progress(path, progress)
            except OSError as err:
                return [(path, f"could not be read ({err}); kept: check again when the file system answers")]
            if digest == e["sha256"]:
                continue
            why = "checksum failure: its SHA-256 differs from the one recorded when it was written"
        moved = quarantine(folder) if quarantine_damaged else None
        return [(path, why + (f"; moved the shard aside to {moved}, the next run rebuilds it" if moved else ""))]
    return []


def check_stats(root: str | os.PathLike, progress: Callable[[int], None] | None = None,
                quarantine_damaged: bool = True) -> list[tuple[Path, str]]:
    """Check the statistics files of the store whose join folder is ``root`` against the SHA-256
    its manifest recorded; a damaged one is moved aside (the next run rebuilds the join).
    Returns ``(path, what is wrong)`` per damaged file."""
    from .common import quarantine_file
    root = Path(root)
    problems = []
    for key, want in sorted(json.loads((root / MANIFEST).read_text()).get("stats", {}).items()):
        p = root / f"stats-{key}.npy"
        got = sha256_with_progress(p, progress) if p.is_file() else None
        if got != want:
            moved = quarantine_file(p) if quarantine_damaged and got is not None else None
            problems.append((p, ("missing" if got is None else "checksum failure: its SHA-256 differs from the manifest's")
                             + (f"; moved it aside to {moved}, the next run rebuilds the join" if moved else "")))
    return problems


def check_store(root: str | os.PathLike, progress: Callable[[int], None] | None = None,
                quarantine_damaged: bool = True) -> list[tuple[Path, str]]:
    """Check every byte of every shard file of the store at ``root`` (its join folder) and of its
    statistics files (:func:`check_shard`, :func:`check_stats`): ``(path, what is wrong)`` per
    damaged shard or file, empty when the store is whole."""
    problems = []
    for folder, files in store_shards(root):
        problems += check_shard(folder, files, progress, quarantine_damaged)
    return problems + check_stats(root, progress, quarantine_damaged)


def sha256_with_progress(path: str | os.PathLike, progress: Callable[[int], None] | None = None) -> str:
    """SHA-256 (hex) of a whole file, calling ``progress(bytes)`` after each piece read."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(CHUNK):
            h.update(block)
            if progress:
                progress(len(block))
    return h.hexdigest()
