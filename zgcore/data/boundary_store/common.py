"""What every part of the boundary store shares: the format version, storage dtypes, the store's
error, the finiteness check, and the one definition of per-channel RMS statistics (used by the
cache build, online targets and the report's boundary-shift measurement)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from zgcore.atomic import set_aside
from zgcore.device import DTYPE_NAMES, torch_dtype

# 3: sharded store (one HDF5 file per shard per boundary, Fletcher32 checksums, a join manifest)
# 4: ``h`` stored contiguous and unfiltered, an xxh3_64 checksum per sequence in dataset ``xxh3``
#    (HDF5's Fletcher32 filter held reads at 0.24-0.59x a raw read of the same bytes)
# 5: the files of format 4, and each file's record also holds ``data`` ([offset, bytes] of h's sequence
#    data) and ``outside_sha256`` (every other byte), checked at open instead of hashing the whole file
#    (start-up no longer grows with the store; the whole-file check is ``zerograph verify``)
# 6: the files of format 5, whose values were checked finite on their stored bits when written (after
#    rounding to the storage dtype, where float16 overflows above 65504: such a build now fails), so a
#    read checks each sequence's xxh3 only: bytes equal to finite written bytes are finite. The
#    finiteness pass at read cost about a quarter of a reading thread's CPU (bench/README.md)
FORMAT_VERSION = 6
# versions BoundaryReader still reads (3: through HDF5's Fletcher32 filter; 4: whole-file SHA-256 at open;
# 3-5 are also checked finite at read: their writers checked the values before rounding them)
READABLE_VERSIONS = (3, 4, 5, 6, 7)
# 7: the files of format 6 holding a boundary codec's bytes (``boundary.codec``, :mod:`.codec`): ``h`` uint8
#    [rows, sequence_bytes], one encoded sequence per row (codes and scales), the manifest's ``codec`` names it.
#    A store without a codec is still written as format 6, byte for byte
CODEC_FORMAT = 7
# the first format whose writer checked the stored (rounded) values finite
FINITE_AT_WRITE = 6
SHARD_FILE = "shard.json"  # a shard's record
MANIFEST = "manifest.json"  # the join's record
# Per-channel statistics come from the first STATS_SEQUENCES training sequences, so that online
# targets (which never see the whole cache) compute exactly the same numbers.
STATS_SEQUENCES = 64
TORCH_DTYPES = {name: torch_dtype(name) for name in DTYPE_NAMES}
# h5py has no bfloat16: store its bit pattern as uint16.
H5_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


class BoundaryStoreError(RuntimeError):
    """A boundary store that is missing, truncated, damaged, non-finite, or does not match what
    the reader expects. The message names the file."""


def sequence_checksums(a: np.ndarray) -> np.ndarray:
    """xxh3_64 of each sequence's stored bytes: ``a`` ``[n, seq_len, hidden]`` (storage dtype) ->
    uint64 ``[n]``. The store's own per-sequence checksum (format 4); xxh3 runs at ~15 GB/s on one
    core here, zlib's CRC-32 at ~1.1 GB/s (``bench/README.md``)."""
    import xxhash

    a = np.ascontiguousarray(a)
    return np.array([xxhash.xxh3_64_intdigest(a[i]) for i in range(len(a))], dtype=np.uint64)


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


def stored_tensor(a: np.ndarray, dtype: str) -> torch.Tensor:
    """The stored array of :func:`to_storage` as a tensor of the storage dtype, sharing its memory
    (bfloat16: its uint16 bits viewed as bfloat16; no widening)."""
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def check_finite(t: torch.Tensor, where: str) -> None:
    """Raise :class:`BoundaryStoreError` naming ``where`` if ``t`` holds NaN or ±inf: a damaged or
    numerically broken boundary must never train anything."""
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise BoundaryStoreError(f"{where}: {bad} non-finite value(s) (NaN/inf) in a teacher boundary; "
                                 "a damaged or numerically broken cache must not train anything "
                                 "(check the teacher, teacher_dtype, or the cache files)")


def sequence_sumsq(h: torch.Tensor) -> torch.Tensor:
    """Per-sequence, per-channel sums of squares of boundary ``h`` ``[n, seq, hidden]`` (float32
    values as stored): float64 ``[n, 2, hidden]``, row 0 position 0 (the attention sink), row 1
    positions >= 1. Computed one sequence at a time, so a sequence's sums never depend on which
    batch or shard it came in."""
    hs = h.detach().double().cpu()
    out = torch.zeros(len(hs), 2, h.shape[-1], dtype=torch.float64)
    for i in range(len(hs)):
        out[i, 0] = hs[i, 0] ** 2
        out[i, 1] = (hs[i, 1:] ** 2).sum(0)
    return out


def rms_from_sumsq(sumsq: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Per-channel RMS ``[2, hidden]`` float32 from :func:`sequence_sumsq` rows ``[n, 2, hidden]``
    (summed over sequences in order: the result depends only on the sequences, never on sharding)."""
    n = sumsq.shape[0]
    tot = sumsq.sum(0)
    return torch.stack([(tot[0] / n).sqrt(), (tot[1] / (n * max(1, seq_len - 1))).sqrt()]).float()


def channel_rms(h: torch.Tensor) -> torch.Tensor:
    """Per-channel RMS of boundary ``h`` ``[n, seq, hidden]``: float32 ``[2, hidden]`` (row 0:
    position 0, row 1: positions >= 1). The one definition of the store's channel statistics."""
    return rms_from_sumsq(sequence_sumsq(h), h.shape[1])


def system_error(e: BaseException) -> bool:
    """Whether ``e`` is the file system's error rather than the file's: an ``OSError`` carrying an
    errno (EMFILE, EIO, ESTALE, ENOSPC, EACCES, ...; h5py sets it from HDF5's error stack when the
    operating system failed). Such an error never quarantines anything: the bytes may be sound, and
    moving a verified shard aside would make the teacher recompute it and other readers fail."""
    return isinstance(e, OSError) and e.errno is not None


def unavailable(path, e: OSError):
    """Raise :class:`BoundaryStoreError` for a file the file system could not serve (``e``: an
    ``OSError``), one line naming the file and the system's error; nothing is moved."""
    why = f"[Errno {e.errno}] {e.strerror}" if e.errno is not None and e.strerror else f"{type(e).__name__}: {e}"
    raise BoundaryStoreError(f"boundary shard file {path} could not be read ({why}); it is kept: rerun when the "
                             "file system answers again") from e


def quarantine(folder: Path) -> Path | None:
    """Move a damaged shard folder aside (``<name>.damaged-<unix time>``), so that the next run
    finds the shard missing and rebuilds it; returns the new path (None if already gone)."""
    folder = Path(folder)
    return quarantine_file(folder) if folder.is_dir() else None


def quarantine_file(path: Path) -> Path | None:
    """Move a damaged file aside (``<name>.damaged-<unix time>``, :func:`zgcore.atomic.set_aside`)
    so that the task that wrote it finds its output incomplete and rebuilds it; returns the new path
    (None if it could not)."""
    return set_aside(path)


class StoredForm:
    """What the store holds for one boundary value and how it comes back: ``dtype`` (float32 / float16 /
    bfloat16) or, with ``codec`` (:class:`.codec.Codec`), the codec's bytes. The one path the writer and
    online targets both take, so they give the same bits."""

    def __init__(self, dtype: str, codec=None):
        self.dtype, self.codec = dtype, codec
        self.format_version = FORMAT_VERSION if codec is None else CODEC_FORMAT
        self.h5_dtype = H5_DTYPES[dtype] if codec is None else np.uint8

    def row_shape(self, seq_len: int, hidden: int) -> tuple[int, ...]:
        """The shape of one stored sequence: ``(seq_len, hidden)``, or ``(sequence_bytes,)`` with a codec."""
        return (seq_len, hidden) if self.codec is None else (self.codec.sequence_bytes,)

    def extra(self) -> dict:
        """Entries a shard record and the manifest carry for this form (``codec`` with a codec; none else)."""
        return {} if self.codec is None else {"codec": self.codec.record()}

    def store(self, h: torch.Tensor, where: str) -> np.ndarray:
        """The stored array of float32 ``h`` ``[n, seq_len, hidden]``, checked finite as stored (16-bit: the
        rounded values; a codec: ``h`` and every scale). Raises :class:`BoundaryStoreError` naming ``where``."""
        if self.codec is None:
            stored = to_storage(h, self.dtype)
            check_finite(stored_tensor(stored, self.dtype), f"{where}, stored as {self.dtype}")
            return stored
        check_finite(h, f"{where}, encoded as {self.codec.name}")
        codes, scales = self.codec.encode(h)
        check_finite(scales, f"{where}: the {self.codec.name} codec's scales")
        return codes.numpy()

    def round_trip(self, h: torch.Tensor, stored: np.ndarray | None = None) -> torch.Tensor:
        """What reading ``h`` back gives (float32; a codec: decoded from ``stored``, the :meth:`store` of ``h``,
        when given)."""
        if self.codec is None:
            return round_trip(h, self.dtype)
        return self.codec.decode(torch.from_numpy(np.ascontiguousarray(stored)) if stored is not None
                                 else self.codec.encode(h)[0])
