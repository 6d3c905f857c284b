"""Writing the store: the shard plan, one shard (the teacher over one contiguous range of
sequences), and the join that presents the shards as one store.

Layout. A shard folder holds, per boundary ``b``, ``b<b>.h5`` with dataset ``h``
``[rows, seq_len, hidden]`` (storage dtype, contiguous and unfiltered: one sequence's bytes follow
the previous one's), ``xxh3`` ``[rows]`` uint64 (the xxh3_64 of each sequence's stored bytes,
checked by the reader on every read; format 4) and, for training rows among the first ``STATS_SEQUENCES``, ``sumsq`` ``[k, 2, hidden]``
float64 (per-sequence sums of squares); plus ``shard.json`` (its range, shape, files with bytes,
SHA-256 of every byte, the byte range of ``h``'s sequence data and the SHA-256 of every byte
outside it (format 5, :func:`~zgcore.data.boundary_store.integrity.file_record`), build time).
The join folder holds ``manifest.json`` (the store's shape and fingerprints, every shard's
folder relative to the join folder, its files' records as in ``shard.json``, build times: sum and wall, and the SHA-256 of each statistics file) and ``stats-b<b>.npy``
(per-channel RMS ``[2, hidden]`` float32).
Nothing is copied: readers index the shard files through the manifest, and a reader of one
boundary opens only that boundary's files.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import h5py
import numpy as np
import torch

from zgcore.models.adapters import capture_boundaries
from zgcore.atomic import atomic_path, write_json
from zgcore.hashing import file_sha256
from zgcore.progress import progress_bar
from . import codec as codec_mod
from ..h5write import abandon, close_all
from .integrity import file_record, outside_sha256
from .common import (MANIFEST, SHARD_FILE, STATS_SEQUENCES, BoundaryStoreError, StoredForm, planned_bytes, quarantine,
                     rms_from_sumsq, sequence_checksums, sequence_sumsq, system_error, unavailable)

# what every shard of one store must agree on
SHAPE_KEYS = ("format_version", "boundaries", "dtype", "teacher_dtype", "seq_len", "hidden_size", "batch_size")


def plan_shards(n: Mapping[str, int], shard_sequences: int) -> list[tuple[str, int, int]]:
    """The shards of a store: ``(split, lo, hi)`` contiguous ranges of at most ``shard_sequences``
    sequences, train first then val. Raises ``ValueError`` if ``shard_sequences < 1``."""
    if int(shard_sequences) < 1:
        raise ValueError(f"shard_sequences must be at least 1, got {shard_sequences}")
    return [(s, lo, min(lo + int(shard_sequences), int(n[s]))) for s in ("train", "val")
            for lo in range(0, int(n[s]), int(shard_sequences))]


def write_shard(folder: str | os.PathLike, teacher, rows: np.ndarray, split: str, lo: int, boundaries: Sequence[int],
                dtype: str, batch_size: int, extra: Mapping[str, Any],
                progress: Callable[[int, int], None] | None = None,
                peak_rss: Callable[[], float | None] | None = None,
                capture: Callable[[torch.Tensor], Mapping[int, torch.Tensor]] | None = None,
                width: int | None = None, desc: str | None = None,
                codec: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run the frozen ``teacher`` over ``rows`` (token ids ``[m, seq_len]``, sequences
    ``lo .. lo+m-1`` of ``split``) and write the shard's files into ``folder`` (which must exist;
    the caller renames it into place). Batches start at ``lo``, so with ``lo`` a multiple of
    ``batch_size`` every sequence sees the same batch as in an unsharded build. ``peak_rss``: called
    once at the end, its figure (MiB) is recorded as the shard's ``peak_rss_mib``. ``capture``:
    ``capture(ids [B, seq_len] int64) -> {b: float32 [B, seq_len, width]}`` computes what is stored
    instead of the teacher's boundaries (the top-k logit store, :mod:`zgcore.data.logit_store`,
    stores its records so), ``width`` their last dimension (default: the teacher's hidden size).
    ``desc``: the name on the progress bar (sequences per second, on stderr). ``codec``: ``{"name", "keep"}``
    of a boundary codec (:mod:`.codec`; ``None`` or name ``"none"``: ``dtype`` as it is): each sequence is
    stored as its encoded bytes (``h`` uint8 ``[m, sequence_bytes]``, format 7), its scales checked finite.

    Returns the shard record (also written to ``shard.json``). Raises
    :class:`BoundaryStoreError` if the teacher produces a non-finite boundary.
    """
    folder = Path(folder)
    device = next(teacher.parameters()).device
    hidden = int(width) if width is not None else int(teacher.config.hidden_size)
    seq_len, m = int(rows.shape[1]), len(rows)
    n_stats = max(0, min(m, STATS_SEQUENCES - lo)) if split == "train" else 0
    started, t0 = time.time(), time.perf_counter()
    codec = codec or {}
    enc = StoredForm(dtype, codec_mod.make(codec.get("name"), seq_len, hidden, int(codec.get("keep", 0))))
    files = {b: h5py.File(folder / f"b{b}.h5", "w") for b in boundaries}
    try:
        # contiguous, no filter: a run of consecutive sequences is one plain read; xxh3 checks each sequence
        dsets = {b: f.create_dataset("h", shape=(m, *enc.row_shape(seq_len, hidden)), dtype=enc.h5_dtype)
                 for b, f in files.items()}
        sums = {b: f.create_dataset("xxh3", shape=(m,), dtype=np.uint64) for b, f in files.items()}
        sumsq = {b: [] for b in boundaries}
        bar = progress_bar(m, desc or f"teacher {split} {lo}..{lo + m - 1}", "seq")
        for k in range(0, m, batch_size):
            ids = torch.from_numpy(rows[k: k + batch_size].astype(np.int64)).to(device)
            captured = capture(ids) if capture is not None else capture_boundaries(teacher, ids, boundaries)
            for b, h in captured.items():
                # on the stored (rounded) values: float16 turns a finite float32 above 65504 into inf. A read then
                # checks each sequence's xxh3 only (format 6): bytes equal to these are finite
                where = f"teacher output at boundary {b}, {split} sequences {lo + k}..{lo + k + len(ids) - 1}"
                stored = enc.store(h, where)
                dsets[b][k: k + len(ids)] = stored
                sums[b][k: k + len(ids)] = sequence_checksums(stored)
                if k < n_stats:
                    sumsq[b].append(sequence_sumsq(enc.round_trip(h[: n_stats - k], stored[: n_stats - k])))
            bar.update(len(ids))
            if progress:
                progress(k + len(ids), m)
        bar.close()
        for b, f in files.items():
            if n_stats:  # kept referenced until the files close (zgcore/data/h5write.py)
                sums[b] = (sums[b], f.create_dataset("sumsq", data=torch.cat(sumsq[b]).numpy(), fletcher32=True))
    except BaseException:
        abandon(files.values())  # a full disk: closed without writing, no crash (zgcore/data/h5write.py)
        raise
    close_all(files.values())  # flushed first, then closed
    rec = {"format_version": enc.format_version, **enc.extra(), "split": split, "lo": int(lo), "hi": int(lo + m),
           "boundaries": [int(b) for b in boundaries], "dtype": dtype, "seq_len": seq_len, "hidden_size": hidden,
           "batch_size": int(batch_size), "stats_rows": int(n_stats), **extra,
           "files": {f"b{b}": file_record(folder / f"b{b}.h5") for b in boundaries},
           "build_seconds": time.perf_counter() - t0, "started": started, "finished": time.time(),
           "peak_rss_mib": peak_rss() if peak_rss else None}
    write_json(folder / SHARD_FILE, rec)
    return rec


def read_shard_record(folder: str | os.PathLike) -> dict[str, Any]:
    """A shard's ``shard.json``. Raises :class:`BoundaryStoreError` if it is missing."""
    p = Path(folder) / SHARD_FILE
    if not p.is_file():
        raise BoundaryStoreError(f"boundary shard {folder} has no {SHARD_FILE} (incomplete or not a shard)")
    return json.loads(p.read_text())


def shard_problem(folder: str | os.PathLike, rec: Mapping[str, Any] | None = None) -> str | None:
    """Cheap completeness check of a shard folder (record present, every file present with its
    recorded size): ``None`` when sound, else what is wrong. Content is checked on read (the bytes
    outside the sequence data when the file is first opened, each sequence's xxh3_64 on every read)
    and in full by ``zerograph verify``."""
    try:
        rec = rec if rec is not None else read_shard_record(folder)
    except BoundaryStoreError as e:
        return str(e)
    for f in rec["files"].values():
        p = Path(folder) / f["name"]
        if not p.is_file() or p.stat().st_size != f["bytes"]:
            return f"{p} is missing or not {f['bytes']} bytes"
    return None


def join_shards(folder: str | os.PathLike, shard_folders: Sequence[str | os.PathLike], n: Mapping[str, int],
                extra: Mapping[str, Any]) -> dict[str, Any]:
    """Write the join of ``shard_folders`` into ``folder`` (which must exist): ``manifest.json``
    and the per-channel statistics. Reads only the shards' records and statistics rows.

    Args:
        n: ``{"train": n_train, "val": n_val}``. extra: entries the manifest must carry (and every
            shard must agree with), e.g. fingerprints.

    Raises:
        BoundaryStoreError: a shard is incomplete, the shards disagree on shape or manifest, or
            they do not tile both splits exactly.
    """
    folder = Path(folder)
    recs = []
    for sf in shard_folders:
        rec = read_shard_record(sf)
        problem = shard_problem(sf, rec)
        if problem:
            raise BoundaryStoreError(f"boundary shard {sf}: {problem}")
        recs.append((Path(sf), rec))
    first = recs[0][1]
    for sf, rec in recs:
        for k in (*SHAPE_KEYS, "codec", *extra):
            want = extra[k] if k in extra else first.get(k)
            if rec.get(k) != want:
                raise BoundaryStoreError(f"boundary shard {sf} disagrees with the store on {k}: {rec.get(k)!r} vs {want!r}")
    for s in ("train", "val"):
        ranges = sorted((r["lo"], r["hi"]) for _, r in recs if r["split"] == s)
        ends = [0] + [hi for _, hi in ranges]
        if [lo for lo, _ in ranges] != ends[:-1] or ends[-1] != int(n[s]):
            raise BoundaryStoreError(f"the shards' {s} ranges {ranges} do not tile 0..{n[s]}")
    bs, seq_len = first["boundaries"], first["seq_len"]
    for b in bs:
        rows = []
        for sf, rec in sorted(recs, key=lambda x: (x[1]["split"], x[1]["lo"])):
            if rec["stats_rows"]:
                rows.append(torch.from_numpy(_read_sumsq(sf, rec["files"][f"b{b}"])))
        np.save(folder / f"stats-b{b}.npy", rms_from_sumsq(torch.cat(rows), seq_len).numpy())
    stats = {f"b{b}": file_sha256(folder / f"stats-b{b}.npy") for b in bs}  # checked by BoundaryReader.stats
    shards = [{"split": r["split"], "lo": r["lo"], "hi": r["hi"], "dir": os.path.relpath(sf, folder),
               "files": r["files"], "build_seconds": r["build_seconds"], "peak_rss_mib": r.get("peak_rss_mib")}
              for sf, r in recs]
    peaks = [r["peak_rss_mib"] for r in shards if r["peak_rss_mib"] is not None]
    codec = {"codec": first["codec"]} if "codec" in first else {}  # format 7
    manifest = {k: first.get(k) for k in SHAPE_KEYS} | codec | dict(extra) | {
        "n_train": int(n["train"]), "n_val": int(n["val"]), "n_shards": len(recs), "shards": shards, "stats": stats,
        "bytes": sum(f["bytes"] for _, r in recs for f in r["files"].values()),
        "build_seconds": sum(r["build_seconds"] for _, r in recs),  # teacher compute: the sum over shards
        "build_wall_seconds": max(r["finished"] for _, r in recs) - min(r["started"] for _, r in recs),
        "peak_rss_mib": max(peaks) if peaks else None}  # the largest shard task's peak resident memory
    write_json(folder / MANIFEST, manifest)
    return manifest


def _read_sumsq(folder: Path, entry: Mapping[str, Any]) -> np.ndarray:
    """A shard file's ``sumsq`` rows, once its bytes match the SHA-256 its record holds (format 5:
    of every byte outside the sequence data, which holds the rows; else of the whole file). Raises
    :class:`BoundaryStoreError` naming the file (and moves the shard aside) on any mismatch or
    HDF5 error, so that the next run rebuilds that shard; an error of the file system (an
    ``OSError`` with an errno) raises it too, moving nothing."""
    path = folder / entry["name"]
    try:
        if "outside_sha256" in entry:
            if outside_sha256(path, entry["data"]) != entry["outside_sha256"]:
                raise BoundaryStoreError("the SHA-256 of its bytes outside the sequence data differs from the one "
                                         "recorded when it was written")
        elif file_sha256(path) != entry["sha256"]:
            raise BoundaryStoreError("its SHA-256 differs from the one recorded when it was written")
        with h5py.File(path, "r") as f:
            return f["sumsq"][...]
    except Exception as e:
        if system_error(e):  # the file system's error (EIO, ESTALE, EMFILE...): nothing is moved
            unavailable(path, e)
        moved = quarantine(folder)
        where = f"; moved the shard aside to {moved}, the next run rebuilds it" if moved else ""
        raise BoundaryStoreError(f"boundary shard file {path}: {e}{where}") from e


def build_store(folder: str | os.PathLike, teacher, tokens: Mapping[str, np.ndarray], boundaries: Sequence[int],
                dtype: str, batch_size: int, extra: Mapping[str, Any], shard_sequences: int = 1024,
                progress: Callable[[int, int], None] | None = None, log=print,
                codec: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Build a whole store in one process (no task graph): every shard under ``folder/shards/``,
    then the join in ``folder`` (atomically). The pipeline runs the same two steps as tasks.

    Args:
        teacher: causal LM or base model (eval). tokens: ``{"train": int [n, T], "val": ...}``.
        progress: called as ``progress(done_sequences, total_sequences)``. codec: as :func:`write_shard`'s.

    Returns the manifest.
    """
    n = {s: len(tokens[s]) for s in ("train", "val")}
    total, hidden = sum(n.values()), int(teacher.config.hidden_size)
    log(f"boundary store: {planned_bytes(total, tokens['train'].shape[1], hidden, len(boundaries), dtype) / 2**20:.1f} "
        f"MiB in {len(plan_shards(n, shard_sequences))} shard(s) to {folder}")
    with atomic_path(folder) as tmp:
        tmp.mkdir(parents=True)
        shard_dirs, done = [], 0
        for split, lo, hi in plan_shards(n, shard_sequences):
            sd = tmp / "shards" / f"{split}-{lo:08d}"
            sd.mkdir(parents=True)
            write_shard(sd, teacher, tokens[split][lo:hi], split, lo, boundaries, dtype, batch_size, extra,
                        progress=(lambda d, m, base=done: progress(base + d, total)) if progress else None, codec=codec)
            done += hi - lo
            shard_dirs.append(sd)
        manifest = join_shards(tmp, shard_dirs, n, extra)
    return manifest
