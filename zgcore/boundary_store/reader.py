"""Reading the store: :class:`BoundaryReader` serves boundary tensors through the join's
manifest, opening a shard's file of boundary ``b`` only when ``b`` is read (a block's worker
touches the files of its two boundaries, nothing else), checking shapes, checksums and finiteness."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import h5py
import numpy as np
import torch

from .common import FORMAT_VERSION, BoundaryStoreError, check_finite, from_storage, quarantine
from .shards import MANIFEST


class BoundaryReader:
    """Serves boundary tensors from a sharded store without loading it into memory.

    Args:
        path: the store's join folder (holding ``manifest.json``), or that file.
        expect: manifest entries the caller relies on (e.g. fingerprints, boundaries); any
            mismatch raises.

    Raises:
        BoundaryStoreError: missing manifest, bad format version, a manifest mismatch, a shard
            file missing or of the wrong size (checked by ``stat`` when opened), or when read: a
            dataset of the wrong shape, a failed Fletcher32 checksum or a non-finite value. A
            shard that fails its checksum or holds a non-finite value is moved aside
            (``<shard>.damaged-<time>``) so that the next run rebuilds that shard only; the
            message names the file.
    """

    def __init__(self, path: str | os.PathLike, expect: Mapping[str, Any] | None = None):
        p = Path(path)
        self.root = p.parent if p.name == MANIFEST else p
        man = self.root / MANIFEST
        if not man.is_file():
            raise BoundaryStoreError(f"boundary store {self.root} has no {MANIFEST}")
        try:
            self.manifest = m = json.loads(man.read_text())
        except ValueError as e:
            raise BoundaryStoreError(f"{man} is not valid JSON: {e}") from e
        if m.get("format_version") != FORMAT_VERSION:
            raise BoundaryStoreError(f"{man}: format version {m.get('format_version')} != {FORMAT_VERSION}")
        for k, v in (expect or {}).items():
            if m.get(k) != v:
                raise BoundaryStoreError(f"{man}: manifest {k}={m.get(k)!r} but expected {v!r}")
        self.dtype = m["dtype"]
        self.shards = {s: sorted((sh for sh in m["shards"] if sh["split"] == s), key=lambda sh: sh["lo"])
                       for s in ("train", "val")}
        for s in ("train", "val"):
            if sum(sh["hi"] - sh["lo"] for sh in self.shards[s]) != self.n(s):
                raise BoundaryStoreError(f"{man}: the {s} shards do not cover {self.n(s)} sequences")
        self._files: dict[tuple[str, int, int], h5py.File] = {}

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
            path = self._shard_dir(sh) / entry["name"]
            if not path.is_file() or path.stat().st_size != entry["bytes"]:
                raise BoundaryStoreError(f"boundary shard file {path} is missing or not {entry['bytes']} bytes "
                                         "(the manifest's size); rerun to rebuild it")
            try:
                f = h5py.File(path, "r")
            except OSError as e:
                raise BoundaryStoreError(f"boundary shard file {path} is unreadable: {e}") from e
            shape = (sh["hi"] - sh["lo"], self.manifest["seq_len"], self.manifest["hidden_size"])
            if "h" not in f or f["h"].shape != shape:
                f.close()
                raise BoundaryStoreError(f"boundary shard file {path}: dataset h missing or not of shape {shape}")
            self._files[key] = f
        return self._files[key]["h"]

    def _damaged(self, sh, b: int, why: str, err: Exception | None = None):
        path = self._shard_dir(sh) / sh["files"][f"b{b}"]["name"]
        for key in [k for k in self._files if k[1] == sh["lo"] and k[0] == sh["split"]]:
            self._files.pop(key).close()
        moved = quarantine(self._shard_dir(sh))
        where = f"; moved the shard aside to {moved}, the next run rebuilds it" if moved else ""
        raise BoundaryStoreError(f"boundary shard file {path}: {why}{where}") from err

    def read(self, split_name: str, b: int, idx: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Boundary ``b`` for sequences ``idx`` (any order) as float32 ``[len(idx), seq_len, hidden]``."""
        idx = np.asarray(idx, dtype=np.int64)
        uniq, inverse = np.unique(idx, return_inverse=True)  # h5py fancy indexing needs increasing indices
        if len(uniq) and (uniq[0] < 0 or uniq[-1] >= self.n(split_name)):
            raise IndexError(f"sequence index out of range 0..{self.n(split_name) - 1}")
        parts = []
        for sh in self.shards[split_name]:
            sel = uniq[(uniq >= sh["lo"]) & (uniq < sh["hi"])]
            if not len(sel):
                continue
            ds = self._dataset(split_name, sh, b)
            try:
                a = ds[sel - sh["lo"]]
            except OSError as e:  # HDF5's Fletcher32 filter refuses a chunk whose checksum fails
                self._damaged(sh, b, f"checksum failure while reading ({e})", e)
            t = from_storage(a, self.dtype)
            try:
                check_finite(t, "read")
            except BoundaryStoreError as e:
                self._damaged(sh, b, str(e).split(": ", 1)[1], e)
            parts.append(t)
        t = torch.cat(parts) if parts else torch.empty(0, self.manifest["seq_len"], self.manifest["hidden_size"])
        return t[torch.from_numpy(inverse.reshape(-1))]

    def stats(self, b: int) -> torch.Tensor:
        """Per-channel RMS of boundary ``b`` over the first ``STATS_SEQUENCES`` training sequences:
        float32 ``[2, hidden]`` (row 0: position 0, the attention sink; row 1: positions >= 1)."""
        p = self.root / f"stats-b{b}.npy"
        if not p.is_file():
            raise BoundaryStoreError(f"{p} is missing")
        return torch.from_numpy(np.load(p))

    def batches(self, split_name: str, b_in: int, b_out: int, order: np.ndarray, batch_size: int,
                start: int = 0) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(batch_number, x, y)`` for consecutive ``batch_size`` slices of ``order`` starting
        at batch ``start``; ``x`` is boundary ``b_in``, ``y`` boundary ``b_out``."""
        n_batches = (len(order) + batch_size - 1) // batch_size
        for k in range(start, n_batches):
            idx = order[k * batch_size: (k + 1) * batch_size]
            yield k, self.read(split_name, b_in, idx), self.read(split_name, b_out, idx)

    def close(self) -> None:
        """Close every open shard file."""
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
