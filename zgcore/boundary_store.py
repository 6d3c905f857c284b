"""The boundary store: the teacher's residual stream at every boundary, as versioned HDF5.

Layout of ``boundaries.h5``::

    /train/b<b>   [n_train, seq_len, hidden]  dtype from the manifest, chunked one sequence per chunk
    /val/b<b>     [n_val,   seq_len, hidden]
    /stats/b<b>   [2, hidden] float32: per-channel RMS at position 0 (the attention sink) and at
                  positions >= 1, over the first STATS_SEQUENCES training sequences
    attrs["manifest"]  JSON: format version, teacher and corpus fingerprints, tokenizer, boundaries,
                       dtype, seq_len, hidden_size, split sizes

The file is written under a temporary name and renamed when complete; a reader validates the
manifest and every dataset's shape before serving a batch. Training code asks this module for
batches and never touches h5py.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import h5py
import numpy as np
import torch
from tqdm import tqdm

from .adapters import capture_boundaries
from .atomic import atomic_path

FORMAT_VERSION = 2  # 2: statistics over the first STATS_SEQUENCES sequences
# Per-channel statistics come from the first STATS_SEQUENCES training sequences, so that online
# targets (which never see the whole cache) compute exactly the same numbers.
STATS_SEQUENCES = 64
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# h5py has no bfloat16: store its bit pattern as uint16.
H5_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


class BoundaryStoreError(RuntimeError):
    """A boundary store that is missing, truncated, or does not match what the reader expects."""


def planned_bytes(n_sequences: int, seq_len: int, hidden: int, n_boundaries: int, dtype: str) -> int:
    """Bytes of boundary data a store will hold (excluding HDF5 overhead)."""
    return n_sequences * seq_len * hidden * n_boundaries * np.dtype(H5_DTYPES[dtype]).itemsize


def to_storage(t: torch.Tensor, dtype: str) -> np.ndarray:
    """Convert a float32 tensor to the numpy array stored for ``dtype`` (bfloat16 as uint16 bits)."""
    t = t.to(TORCH_DTYPES[dtype]).cpu()
    if dtype == "bfloat16":
        return t.view(torch.uint16).numpy()
    return t.numpy()


def from_storage(a: np.ndarray, dtype: str) -> torch.Tensor:
    """Inverse of :func:`to_storage`; returns float32."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    return t.float()


def round_trip(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """What reading ``t`` back from a store of ``dtype`` gives (float32), without a file."""
    return t.to(TORCH_DTYPES[dtype]).float()


def write_store(path: str | os.PathLike, teacher, tokens: Mapping[str, np.ndarray], boundaries: Sequence[int],
                dtype: str, batch_size: int, manifest_extra: Mapping[str, Any],
                progress: Callable[[int, int], None] | None = None, log=print) -> dict[str, Any]:
    """Run the frozen ``teacher`` over ``tokens`` and write every boundary to ``path`` atomically.

    Args:
        teacher: causal LM (float32, eval). tokens: ``{"train": int array [n, T], "val": ...}``.
        boundaries: strictly increasing layer indices starting at 0.
        dtype: storage dtype name. batch_size: sequences per teacher forward.
        manifest_extra: fingerprints etc. merged into the manifest.
        progress: called as ``progress(done_sequences, total_sequences)``.

    Returns:
        The manifest (dict), also stored in ``attrs["manifest"]``.
    """
    device = next(teacher.parameters()).device
    hidden = int(teacher.config.hidden_size)
    seq_len = int(tokens["train"].shape[1])
    total = sum(len(v) for v in tokens.values())
    size = planned_bytes(total, seq_len, hidden, len(boundaries), dtype)
    log(f"TeacherBoundary: writing {size / 2**20:.1f} MiB ({total} sequences x {seq_len} tokens x {hidden} x "
        f"{len(boundaries)} boundaries, {dtype}) to {path}")
    manifest = {"format_version": FORMAT_VERSION, "boundaries": list(boundaries), "dtype": dtype, "seq_len": seq_len,
                "hidden_size": hidden, "n_train": len(tokens["train"]), "n_val": len(tokens["val"]), **manifest_extra}
    done = 0
    with atomic_path(path) as tmp:
        with h5py.File(tmp, "w") as f, tqdm(total=total, desc="teacher boundaries", unit="seq") as bar:
            sumsq = {b: torch.zeros(2, hidden, dtype=torch.float64) for b in boundaries}
            for split_name in ("train", "val"):
                rows = tokens[split_name]
                g = f.create_group(split_name)
                dsets = {b: g.create_dataset(f"b{b}", shape=(len(rows), seq_len, hidden), dtype=H5_DTYPES[dtype],
                                             chunks=(1, seq_len, hidden)) for b in boundaries}
                for lo in range(0, len(rows), batch_size):
                    ids = torch.from_numpy(rows[lo: lo + batch_size].astype(np.int64)).to(device)
                    caps = capture_boundaries(teacher, ids, boundaries)
                    for b, h in caps.items():
                        dsets[b][lo: lo + len(ids)] = to_storage(h, dtype)
                        if split_name == "train" and lo < STATS_SEQUENCES:
                            accumulate_sumsq(sumsq[b], h[: STATS_SEQUENCES - lo], dtype)
                    done += len(ids)
                    bar.update(len(ids))
                    if progress:
                        progress(done, total)
            n = min(len(tokens["train"]), STATS_SEQUENCES)
            st = f.create_group("stats")
            for b in boundaries:
                st.create_dataset(f"b{b}", data=finish_stats(sumsq[b], n, seq_len).numpy())
            f.attrs["manifest"] = json.dumps(manifest, sort_keys=True)
            f.flush()
    return manifest


def accumulate_sumsq(acc: torch.Tensor, h: torch.Tensor, dtype: str) -> None:
    """Add the per-channel sums of squares of ``h`` ``[batch, seq, hidden]`` (as stored in
    ``dtype``) to ``acc`` ``[2, hidden]`` float64: row 0 position 0, row 1 positions >= 1."""
    hs = round_trip(h, dtype).double().cpu()
    acc[0] += (hs[:, 0] ** 2).sum(0)
    acc[1] += (hs[:, 1:] ** 2).sum((0, 1))


def finish_stats(acc: torch.Tensor, n: int, seq_len: int) -> torch.Tensor:
    """Per-channel RMS ``[2, hidden]`` float32 from sums of squares over ``n`` sequences."""
    return torch.stack([(acc[0] / n).sqrt(), (acc[1] / (n * max(1, seq_len - 1))).sqrt()]).float()


class OnlineBoundaries:
    """Online targets: the same interface as :class:`BoundaryReader` for training, but boundaries
    are computed by running the frozen teacher on each batch instead of read from the cache.

    Values are rounded through the storage ``dtype`` exactly as a cache would store them, and the
    per-channel statistics come from the same first ``STATS_SEQUENCES`` sequences in the same
    batches, so an objective-matched run gives the same bits as with cached targets.

    Args:
        teacher: frozen causal LM. tokens: training token ids ``[n, seq_len]`` (int).
        boundaries: the boundaries this block needs (e.g. ``[b_i, b_i+1]``). dtype: storage dtype name.
        batch_size: teacher batch size for the statistics pass (the cache build's ``batch_size``).

    Attributes:
        teacher_seconds: wall time spent in the teacher so far (s).
    """

    def __init__(self, teacher, tokens: np.ndarray, boundaries: Sequence[int], dtype: str, batch_size: int):
        import time

        self.teacher, self.tokens, self.dtype = teacher, tokens, dtype
        self.boundaries = sorted(set(boundaries))
        self.device = next(teacher.parameters()).device
        seq_len, hidden = tokens.shape[1], int(teacher.config.hidden_size)
        acc = {b: torch.zeros(2, hidden, dtype=torch.float64) for b in self.boundaries}
        n = min(len(tokens), STATS_SEQUENCES)
        t0 = time.perf_counter()
        for lo in range(0, n, batch_size):
            ids = torch.from_numpy(tokens[lo: min(lo + batch_size, len(tokens))].astype(np.int64)).to(self.device)
            for b, h in capture_boundaries(teacher, ids, self.boundaries).items():
                accumulate_sumsq(acc[b], h[: n - lo], dtype)
        self._stats = {b: finish_stats(acc[b], n, seq_len) for b in self.boundaries}
        self.teacher_seconds = time.perf_counter() - t0

    def n(self, split_name: str) -> int:
        """Number of training sequences (only ``"train"`` is served online)."""
        return len(self.tokens)

    def stats(self, b: int) -> torch.Tensor:
        """Per-channel RMS of boundary ``b``, ``[2, hidden]`` float32 (as :meth:`BoundaryReader.stats`)."""
        return self._stats[b]

    def read(self, split_name: str, b: int, idx) -> torch.Tensor:
        """Boundary ``b`` for sequences ``idx``, computed now: float32 ``[len(idx), seq_len, hidden]``."""
        return self._pair(idx, [b])[b]

    def _pair(self, idx, bs):
        import time

        t0 = time.perf_counter()
        ids = torch.from_numpy(self.tokens[np.asarray(idx)].astype(np.int64)).to(self.device)
        caps = capture_boundaries(self.teacher, ids, bs)
        out = {b: round_trip(h, self.dtype).cpu() for b, h in caps.items()}
        self.teacher_seconds += time.perf_counter() - t0
        return out

    def batches(self, split_name: str, b_in: int, b_out: int, order: np.ndarray, batch_size: int,
                start: int = 0) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """As :meth:`BoundaryReader.batches`, running the teacher once per batch for both boundaries."""
        n_batches = (len(order) + batch_size - 1) // batch_size
        for k in range(start, n_batches):
            caps = self._pair(order[k * batch_size: (k + 1) * batch_size], [b_in, b_out])
            yield k, caps[b_in], caps[b_out]

    def close(self) -> None:
        """Nothing to close (interface parity with :class:`BoundaryReader`)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class BoundaryReader:
    """Serves boundary tensors from a store without loading the file into memory.

    Args:
        path: the ``boundaries.h5`` file.
        expect: manifest entries the caller relies on (e.g. fingerprints, boundaries); any
            mismatch raises.

    Raises:
        BoundaryStoreError: missing file, bad format version, a manifest mismatch, or a dataset
            whose shape does not match the manifest (e.g. a truncated store).
    """

    def __init__(self, path: str | os.PathLike, expect: Mapping[str, Any] | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise BoundaryStoreError(f"boundary store {self.path} does not exist")
        try:
            self.f = h5py.File(self.path, "r")
            self.manifest = json.loads(self.f.attrs["manifest"])
        except (OSError, KeyError, ValueError) as e:
            raise BoundaryStoreError(f"boundary store {self.path} is unreadable or has no manifest: {e}") from e
        m = self.manifest
        if m.get("format_version") != FORMAT_VERSION:
            raise BoundaryStoreError(f"{self.path}: format version {m.get('format_version')} != {FORMAT_VERSION}")
        for k, v in (expect or {}).items():
            if m.get(k) != v:
                raise BoundaryStoreError(f"{self.path}: manifest {k}={m.get(k)!r} but expected {v!r}")
        for split_name, n in (("train", m["n_train"]), ("val", m["n_val"])):
            for b in m["boundaries"]:
                key = f"{split_name}/b{b}"
                if key not in self.f or self.f[key].shape != (n, m["seq_len"], m["hidden_size"]):
                    raise BoundaryStoreError(f"{self.path}: dataset {key} missing or has the wrong shape")
        self.dtype = m["dtype"]

    def __len__(self) -> int:
        return int(self.manifest["n_train"])

    def n(self, split_name: str) -> int:
        """Number of sequences in ``split_name`` (``"train"`` or ``"val"``)."""
        return int(self.manifest[f"n_{split_name}"])

    def read(self, split_name: str, b: int, idx: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Boundary ``b`` for sequences ``idx`` (any order) as float32 ``[len(idx), seq_len, hidden]``."""
        idx = np.asarray(idx, dtype=np.int64)
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        uniq, inverse = np.unique(sorted_idx, return_inverse=True)
        a = self.f[f"{split_name}/b{b}"][uniq]  # h5py fancy indexing needs increasing indices
        t = from_storage(a, self.dtype)[torch.from_numpy(inverse)]
        out = torch.empty_like(t)
        out[torch.from_numpy(order)] = t
        return out

    def stats(self, b: int) -> torch.Tensor:
        """Per-channel RMS of boundary ``b`` over the training split: float32 ``[2, hidden]``
        (row 0: position 0, the attention sink; row 1: positions >= 1)."""
        return torch.from_numpy(self.f[f"stats/b{b}"][...])

    def batches(self, split_name: str, b_in: int, b_out: int, order: np.ndarray, batch_size: int,
                start: int = 0) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(batch_number, x, y)`` for consecutive ``batch_size`` slices of ``order`` starting
        at batch ``start``; ``x`` is boundary ``b_in``, ``y`` boundary ``b_out``."""
        n_batches = (len(order) + batch_size - 1) // batch_size
        for k in range(start, n_batches):
            idx = order[k * batch_size: (k + 1) * batch_size]
            yield k, self.read(split_name, b_in, idx), self.read(split_name, b_out, idx)

    def close(self) -> None:
        """Close the file."""
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
