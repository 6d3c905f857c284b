"""Reading the store: :class:`BoundaryReader` serves boundary tensors through the join's
manifest, opening a shard's file of boundary ``b`` only when ``b`` is read (a block's worker
touches the files of its two boundaries, nothing else), checking shapes, checksums and finiteness.

Three formats are read: 5 (the one written now: ``h`` contiguous and unfiltered, each sequence
checked against the xxh3_64 the shard recorded in ``xxh3`` when read, every other byte against a
SHA-256 when the file is opened), 4 (the same files; the whole file hashed when opened: start-up
grows with the file) and 3 (HDF5's Fletcher32 filter checks every chunk; about half as fast, see
``bench/README.md``)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Mapping, Sequence

import h5py
import numpy as np
import torch
import xxhash

from zgcore.hashing import file_sha256
from . import codec as codec_mod, memory
from .integrity import outside_sha256
from .common import (FINITE_AT_WRITE, FORMAT_VERSION, MANIFEST, READABLE_VERSIONS, TORCH_DTYPES, BoundaryStoreError, check_finite,
                     quarantine, quarantine_file, system_error, unavailable)

# Rows read and checked at a time: about 1 MiB of stored bytes, still in a core's cache when checked
PIECE_BYTES = 1 << 20
# A 16-bit value shifted left by one (sign dropped) is at least this when its exponent bits are all
# ones (inf or NaN): bfloat16 0x7f80 << 1, float16 0x7c00 << 1.
NONFINITE_SHIFTED = {"bfloat16": 0xFF00, "float16": 0xF800}


class BoundaryReader:
    """Serves boundary tensors from a sharded store without loading it into memory.

    Args:
        path: the store's join folder (holding ``manifest.json``), or that file.
        expect: manifest entries the caller relies on (e.g. fingerprints, boundaries); any
            mismatch raises.
        pin_memory: return page-locked tensors (needs CUDA): the shard's bytes are read straight
            into memory from PyTorch's caching host allocator, ready for a ``non_blocking`` copy
            to the GPU — one copy from the page cache, and no page faults on reused blocks.

    Raises:
        BoundaryStoreError: missing manifest, a format version this code cannot read (not 3 to
            6: the message says to rebuild the cache), a manifest mismatch; or, when a shard
            file is first opened: missing, of the wrong size, the bytes a read does not check not
            those of the manifest's SHA-256 (formats 5 and 6: every byte outside the sequence data, a
            few KiB to MiB whatever the file's size; formats 3 and 4: the whole file, about one
            extra read of it at ~1.7 GB/s), not readable as HDF5, a dataset of the wrong shape or
            (formats 5 and 6) not on its recorded byte range; or when read: a sequence whose bytes fail
            the xxh3_64 checksum recorded for it (formats 4 to 6; a failed Fletcher32 checksum for
            format 3) or a non-finite value (formats 3 to 5; format 6's writer checked its stored
            values, so its sequences that pass the xxh3 check are finite). Each of these moves
            the shard aside (``<shard>.damaged-<time>``) so that the next run rebuilds that shard
            only; the message names the file. An error of the file system rather than of the file
            (an ``OSError`` carrying an errno: EMFILE, EIO, ESTALE, ENOSPC, EACCES, ... while
            checking, opening or reading it) never moves anything: the same error, one line naming
            the file and the system's error, and the shard stays for the rerun.
    """

    def __init__(self, path: str | os.PathLike, expect: Mapping[str, Any] | None = None, pin_memory: bool = False):
        self.pin_memory = bool(pin_memory)
        p = Path(path)
        self.root = p.parent if p.name == MANIFEST else p
        man = self.root / MANIFEST
        if not man.is_file():
            raise BoundaryStoreError(f"boundary store {self.root} has no {MANIFEST}")
        try:
            self.manifest = m = json.loads(man.read_text())
        except ValueError as e:
            raise BoundaryStoreError(f"{man} is not valid JSON: {e}") from e
        self.version = m.get("format_version")
        if self.version not in READABLE_VERSIONS:
            raise BoundaryStoreError(f"{man}: format version {self.version} cannot be read by this code (it reads "
                                     f"{', '.join(map(str, READABLE_VERSIONS))}; it writes {FORMAT_VERSION}): rebuild "
                                     "the cache with this code (the pipeline does so under a new name)")
        for k, v in (expect or {}).items():
            if m.get(k) != v:
                raise BoundaryStoreError(f"{man}: manifest {k}={m.get(k)!r} but expected {v!r}")
        self.dtype = m["dtype"]
        try:  # format 7: a boundary codec's bytes, decoded by widen() after the copy to the device
            self.codec = codec_mod.from_record(m.get("codec"), int(m["seq_len"]), int(m["hidden_size"]))
        except (KeyError, TypeError, ValueError) as e:
            raise BoundaryStoreError(f"{man}: codec {m.get('codec')!r} cannot be decoded by this code ({e})") from e
        self._row = ((int(m["seq_len"]), int(m["hidden_size"])) if self.codec is None else (self.codec.sequence_bytes,))
        self.shards = {s: sorted((sh for sh in m["shards"] if sh["split"] == s), key=lambda sh: sh["lo"])
                       for s in ("train", "val")}
        for s in ("train", "val"):
            if sum(sh["hi"] - sh["lo"] for sh in self.shards[s]) != self.n(s):
                raise BoundaryStoreError(f"{man}: the {s} shards do not cover {self.n(s)} sequences")
        self._files: dict[tuple[str, int, int], h5py.File] = {}
        self._ids: dict[tuple[str, int, int], tuple[Any, Any]] = {}  # open dataset h: (DatasetID, file dataspace)
        # format 4, contiguous unfiltered h: (file descriptor, byte offset of h in the file, bytes per sequence)
        self._raw: dict[tuple[str, int, int], tuple[int, int, int]] = {}
        self._sums: dict[tuple[str, int, int], np.ndarray] = {}  # format 4: each file's xxh3 column, uint64 [rows]
        self._pool: dict[tuple, list[torch.Tensor]] = {}  # batch tensors handed out, reused once nobody else holds them
        self._scratch: dict[tuple, np.ndarray] = {}  # reused buffers of read (one reader serves one thread)

    def __len__(self) -> int:
        return int(self.manifest["n_train"])

    def n(self, split_name: str) -> int:
        """Number of sequences in ``split_name`` (``"train"`` or ``"val"``)."""
        return int(self.manifest[f"n_{split_name}"])

    def _shard_dir(self, sh: Mapping[str, Any]) -> Path:
        return (self.root / sh["dir"]).resolve()

    def _dataset(self, split_name: str, sh: Mapping[str, Any], b: int):
        key = (split_name, sh["lo"], b)
        if key not in self._files:
            entry = sh["files"].get(f"b{b}")
            if entry is None:
                raise BoundaryStoreError(f"{self.root}: boundary {b} is not in the store ({self.manifest['boundaries']})")
            self._files[key] = self._open(sh, b, entry)
        return self._files[key]["h"]

    def _open(self, sh: Mapping[str, Any], b: int, entry: Mapping[str, Any]) -> h5py.File:
        """Open a shard's file of boundary ``b`` once the bytes a read does not check match the
        manifest: format 5, the SHA-256 of every byte outside ``h``'s sequence data (HDF5
        metadata, the ``xxh3`` column, statistics rows; the data bytes are checked per sequence
        when read), and ``h`` must lie exactly on the recorded byte range; formats 3 and 4, the
        SHA-256 of the whole file. Any failure to verify, open or find the dataset quarantines
        the shard."""
        path = self._shard_dir(sh) / entry["name"]
        outside = self.version >= 5
        try:
            size = path.stat().st_size if path.is_file() else None
            if size != entry["bytes"]:
                digest = None
            else:
                digest = outside_sha256(path, entry["data"]) if outside else file_sha256(path)
        except OSError as e:  # the file system's error (EIO, ESTALE, EMFILE, EACCES...), not the file's
            unavailable(path, e)
        if size != entry["bytes"]:
            self._damaged(sh, b, f"missing or not {entry['bytes']} bytes (the manifest's size)")
        want = entry["outside_sha256" if outside else "sha256"]
        if digest != want:
            self._damaged(sh, b, f"checksum failure: SHA-256 {digest[:12]}... of its {'bytes outside the sequence data' if outside else 'bytes'} "
                                 f"differs from the manifest's {want[:12]}... (the file changed after it was written)")
        shape = (sh["hi"] - sh["lo"], *self._row)
        try:  # the bytes are as written: an error here means the manifest and the file disagree
            f = h5py.File(path, "r")
            try:
                ok = "h" in f and f["h"].shape == shape
                if ok and self.version >= 4:
                    ok = "xxh3" in f and f["xxh3"].shape == shape[:1] and f["xxh3"].dtype == np.uint64
                if ok and outside:  # every data byte lies in the range the xxh3 sums check, and nowhere else
                    layout = self._raw_layout(f["h"])
                    ok = layout is not None and [layout[0], layout[1] * shape[0]] == list(entry["data"])
                if ok and self.version >= 4:
                    self._sums[(sh["split"], sh["lo"], b)] = f["xxh3"][...]
            except Exception:
                f.close()
                raise
        except Exception as e:  # h5py raises OSError, KeyError, RuntimeError, ValueError on damaged files
            if system_error(e):  # the bytes matched the manifest: EMFILE, EIO, ESTALE... are the file system's
                unavailable(path, e)
            self._damaged(sh, b, f"unreadable as HDF5 ({type(e).__name__}: {e})", e)
        if not ok:
            f.close()
            self._damaged(sh, b, f"dataset h missing or not of shape {shape}" +
                          (f", or dataset xxh3 missing or not uint64 [{shape[0]}]" if self.version >= 4 else "") +
                          (f", or h's data not the recorded bytes {list(entry['data'])}" if outside else ""))
        return f

    def _damaged(self, sh, b: int, why: str, err: Exception | None = None):
        path = self._shard_dir(sh) / sh["files"][f"b{b}"]["name"]
        self._ids.clear()
        self._close_raw()
        for key in [k for k in self._files if k[1] == sh["lo"] and k[0] == sh["split"]]:
            self._sums.pop(key, None)
            self._files.pop(key).close()
        moved = quarantine(self._shard_dir(sh))
        where = f"; moved the shard aside to {moved}, the next run rebuilds it" if moved else ""
        raise BoundaryStoreError(f"boundary shard file {path}: {why}{where}") from err

    def read(self, split_name: str, b: int, idx: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Boundary ``b`` for sequences ``idx`` (any order, repeats allowed) as a tensor of the
        store's dtype (``self.dtype``: torch.float32, torch.bfloat16 or torch.float16)
        ``[len(idx), seq_len, hidden]``, in the order of ``idx``; values bitwise as written.
        16-bit boundaries are NOT widened here: the consumer widens with ``.float()`` after its
        ``.to(device)`` copy (exact: every bfloat16 / float16 value is a float32 value), so a
        16-bit store moves half the bytes of float32 through memory and over PCIe.

        Each run of consecutive sequences of one shard (one sequence in a shuffled order) is read
        ~1 MiB (``PIECE_BYTES``) at a time straight into the returned tensor's memory: with one
        ``os.preadv`` at the dataset's byte offset where its layout allows (:meth:`_raw_layout`;
        format 4 always), else by an HDF5 hyperslab read (about half as fast). While a piece is in
        the core's cache each sequence's xxh3_64 is compared with the one its shard recorded
        (format 4 on). Format 6 stops there: its writer checked the stored (rounded) values finite,
        and bytes equal to them are finite. Formats 3-5, whose writers checked the values before
        rounding, are also checked finite on the stored bits (float32: numpy's ``isfinite``; 16-bit:
        an exponent-all-ones test on the uint16 pattern), a pass that cost about a quarter of a
        reading thread's CPU (``bench/README.md``).
        h5py's list (fancy) indexing, which builds a point selection, ran 20x below the disk, and
        HDF5's Fletcher32 filter held reads to 0.24-0.59x a raw read
        (``bench/data_feed.py``). Format 3 stores are read as before: whole runs through the
        Fletcher32 filter.

        Raises:
            IndexError: an index outside ``0 .. n(split_name) - 1``.
            BoundaryStoreError: a missing or wrong-sized shard file, a failed checksum or a
                non-finite value (the shard is moved aside and named, see the class).
        """
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= self.n(split_name)):
            raise IndexError(f"sequence index out of range 0..{self.n(split_name) - 1}")
        shape = (len(idx), *self._row)  # a codec's store: uint8 [len(idx), sequence_bytes]
        los = np.array([sh["lo"] for sh in self.shards[split_name]], dtype=np.int64)
        owner = np.searchsorted(los, idx, side="right") - 1  # shard of each requested sequence
        # runs: positions j..j+r-1 of idx that are consecutive sequences of one shard
        brk = np.flatnonzero((np.diff(idx) != 1) | (np.diff(owner) != 0)) + 1
        runs = [(int(j), int(r), self.shards[split_name][owner[j]]) for j, r in
                zip(np.r_[0, brk], np.diff(np.r_[0, brk, len(idx)])) if r]
        out, mem = self._empty(shape)
        if self.version < 4:
            return self._read_fletcher32(split_name, b, idx, runs, owner, out, mem)
        half = self.dtype != "float32"
        piece = max(1, PIECE_BYTES // (int(np.prod(shape[1:])) * mem.itemsize))
        finite_at_write = self.version >= FINITE_AT_WRITE  # the xxh3 match is the whole check
        if half and not finite_at_write:
            bits = self._buffer(("bits", piece, *shape[1:]), np.dtype(np.uint16))
        for j, r, sh in runs:
            row0 = int(idx[j] - sh["lo"])
            for p in range(0, r, piece):
                q = min(piece, r - p)
                dest = mem[j + p: j + p + q]
                self._read_run(split_name, sh, b, row0 + p, dest)
                self._check_sums(split_name, sh, b, row0 + p, dest)
                if finite_at_write:
                    continue
                if half:  # sign dropped by the shift; exponent all ones (inf/NaN) sorts above the rest
                    finite = np.left_shift(dest.view(np.uint16), 1, out=bits[:q]).max() < NONFINITE_SHIFTED[self.dtype]
                else:
                    finite = bool(np.isfinite(dest).all())
                if not finite:
                    try:  # the message counts the piece's non-finite values
                        check_finite(out[j + p: j + p + q], "read")
                    except BoundaryStoreError as e:
                        self._damaged(sh, b, str(e).split(": ", 1)[1], e)
        return out

    def _empty(self, shape: tuple) -> tuple[torch.Tensor, np.ndarray]:
        """A tensor of the storage dtype for a batch (:func:`.memory.batch_tensor`: reused once
        nothing refers to it) and a numpy view of its memory in the dtype HDF5 stores (bfloat16:
        its uint16 bit pattern; numpy has no bfloat16)."""
        dtype = TORCH_DTYPES[self.dtype] if self.codec is None else torch.uint8
        out = memory.batch_tensor(self._pool, shape, dtype, self.pin_memory)
        return out, (out.view(torch.int16).numpy().view(np.uint16) if dtype == torch.bfloat16 else out.numpy())

    def widen(self, t: torch.Tensor) -> torch.Tensor:
        """A batch of :meth:`read` as float32 ``[n, seq_len, hidden]`` on ``t``'s device: ``t.float()`` (exact),
        or, for a codec's store, the codec's decode of its bytes (:meth:`.codec.Codec.decode`). Call it after
        the copy to the block's device, so that the encoded bytes are what moves."""
        return t.float() if self.codec is None else self.codec.decode(t)

    def _buffer(self, key: tuple, dtype: np.dtype) -> np.ndarray:
        """A reused scratch array of shape ``key[1:]`` (fresh large arrays cost page faults each call)."""
        if key not in self._scratch:
            self._scratch[key] = np.empty(key[1:], dtype=dtype)
        return self._scratch[key]

    def _check_sums(self, split_name: str, sh: Mapping[str, Any], b: int, row: int, got: np.ndarray) -> None:
        """Compare the xxh3_64 of each sequence in ``got`` (rows ``row ..`` of shard ``sh``'s
        boundary ``b``, as stored) with the one recorded when the shard was written; a mismatch
        moves the shard aside and raises :class:`BoundaryStoreError` naming the file."""
        want = self._sums[(split_name, sh["lo"], b)][row: row + len(got)]
        for i in range(len(got)):
            if xxhash.xxh3_64_intdigest(got[i]) != int(want[i]):
                self._damaged(sh, b, f"checksum failure: sequence {sh['lo'] + row + i}'s bytes differ from the xxh3_64 "
                                     "recorded when the shard was written")

    def _read_fletcher32(self, split_name: str, b: int, idx: np.ndarray, runs: list, owner: np.ndarray,
                         out: torch.Tensor, mem: np.ndarray) -> torch.Tensor:
        """:meth:`read` of a format-3 store: every run is read whole through HDF5's Fletcher32
        filter into ``mem`` (the memory of ``out``, storage dtype), and the batch is checked
        finite in numpy (``torch.isfinite`` is ~15x slower on one thread; bfloat16: an
        exponent-all-ones test on its bits)."""
        for j, r, sh in runs:
            self._read_run(split_name, sh, b, int(idx[j] - sh["lo"]), mem[j: j + r])
        rows = mem.reshape(len(idx), -1)
        bad = (~np.isfinite(rows) if self.dtype != "bfloat16" else (rows & 0x7F80) == 0x7F80).any(1)
        if bad.any():
            first = owner[int(np.flatnonzero(bad)[0])]
            sh = self.shards[split_name][first]
            try:  # the message counts the non-finite values of that shard's rows
                check_finite(out[torch.from_numpy(bad & (owner == first))], "read")
            except BoundaryStoreError as e:
                self._damaged(sh, b, str(e).split(": ", 1)[1], e)
        return out

    def _read_run(self, split_name: str, sh: Mapping[str, Any], b: int, row: int, dest: np.ndarray) -> None:
        """Read rows ``row .. row + len(dest) - 1`` of shard ``sh``'s boundary ``b`` into ``dest``
        (C-contiguous, storage dtype) with one hyperslab selection; an HDF5 error (format 3: a
        failed Fletcher32 checksum) moves the shard aside and raises, naming the file. The
        dataset's low-level id and dataspace are kept per file: opening ``h`` by name and asking
        its dtype cost ~130 us a call, more than reading a small chunk."""
        key = (split_name, sh["lo"], b)
        if key not in self._ids:
            ds = self._dataset(split_name, sh, b)
            if ds.dtype != dest.dtype:
                self._damaged(sh, b, f"dataset h is {ds.dtype}, but the manifest's dtype {self.dtype} is stored as {dest.dtype}")
            self._ids[key] = (ds.id, ds.id.get_space())
            raw = self._raw_layout(ds) if self.version >= 4 else None
            if raw is not None:
                try:
                    self._raw[key] = (os.open(self._files[key].filename, os.O_RDONLY), *raw)
                except OSError as e:
                    unavailable(self._files[key].filename, e)
        if key in self._raw:
            fd, offset, row_bytes = self._raw[key]
            want, got, view = dest.nbytes, 0, memoryview(dest).cast("B")
            try:  # a read may return fewer bytes than asked without being at the end of the file: read on
                while got < want:
                    k = os.preadv(fd, [view[got:]], offset + row * row_bytes + got)
                    if not k:  # the end of the file: truncated
                        break
                    got += k
            except OSError as e:
                unavailable(self._files[key].filename, e)
            if got != want:
                self._damaged(sh, b, f"short read: {got} of {want} bytes at sequence {sh['lo'] + row}")
            return
        dsid, file_space = self._ids[key]
        file_space.select_hyperslab((row, 0, 0), dest.shape)
        try:
            dsid.read(h5py.h5s.create_simple(dest.shape), file_space, dest)
        except Exception as e:  # Fletcher32 refuses a changed chunk (OSError); h5py may also raise KeyError, RuntimeError
            if system_error(e):  # EIO, ESTALE...: the file system's, not the file's
                unavailable(self._files[key].filename, e)
            self._damaged(sh, b, f"checksum failure while reading ({type(e).__name__}: {e})", e)

    @staticmethod
    def _raw_layout(ds) -> tuple[int, int] | None:
        """``(byte offset of the data in the file, bytes per sequence)`` of dataset ``h`` when its
        bytes lie in the file as one C-ordered, unfiltered, little-endian block (format 4 writes it
        so): a run of sequences is then read with one ``os.preadv`` straight into the batch's
        memory, a single copy from the page cache, as fast as reading the file raw (HDF5's own
        hyperslab read of the same bytes ran at about half that, ``bench/data_feed.py``).
        ``None`` (read through HDF5) for any other layout, or where ``os.preadv`` is missing."""
        if not hasattr(os, "preadv") or ds.chunks is not None or ds.id.get_create_plist().get_nfilters():
            return None
        offset = ds.id.get_offset()
        if offset is None or ds.dtype.byteorder == ">" or ds.id.get_storage_size() != ds.size * ds.dtype.itemsize:
            return None
        return int(offset), int(np.prod(ds.shape[1:])) * ds.dtype.itemsize

    def _close_raw(self) -> None:
        for fd, _, _ in self._raw.values():
            os.close(fd)
        self._raw.clear()

    def stats(self, b: int) -> torch.Tensor:
        """Per-channel RMS of boundary ``b`` over the first ``STATS_SEQUENCES`` training sequences:
        float32 ``[2, hidden]`` (row 0: position 0, the attention sink; row 1: positions >= 1).
        The file's SHA-256 is checked against the manifest's first; a mismatch moves the file aside
        (the join is rebuilt on the next run) and raises :class:`BoundaryStoreError`."""
        p = self.root / f"stats-b{b}.npy"
        if not p.is_file():
            raise BoundaryStoreError(f"{p} is missing")
        want = self.manifest.get("stats", {}).get(f"b{b}")  # stores joined before it was recorded: unchecked
        if want is not None and file_sha256(p) != want:
            moved = quarantine_file(p)
            raise BoundaryStoreError(f"{p}: checksum failure: its SHA-256 differs from the manifest's; moved it aside "
                                     f"to {moved}, the next run rebuilds the join")
        try:
            return torch.from_numpy(np.load(p))
        except (OSError, ValueError) as e:
            raise BoundaryStoreError(f"{p} is unreadable ({e})") from e

    def batches(self, split_name: str, b_in: int, b_out: int, order: np.ndarray, batch_size: int,
                start: int = 0) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(batch_number, x, y)`` for consecutive ``batch_size`` slices of ``order`` starting
        at batch ``start``; ``x`` is boundary ``b_in``, ``y`` boundary ``b_out`` (the store's dtype,
        ``[batch, seq_len, hidden]``: widen with ``.float()`` after moving them, see :meth:`read`).
        Raises as :meth:`read`."""
        n_batches = (len(order) + batch_size - 1) // batch_size
        for k in range(start, n_batches):
            idx = order[k * batch_size: (k + 1) * batch_size]
            yield k, self.read(split_name, b_in, idx), self.read(split_name, b_out, idx)

    def close(self) -> None:
        """Close every open shard file."""
        self._ids.clear()
        self._close_raw()
        self._sums.clear()
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
