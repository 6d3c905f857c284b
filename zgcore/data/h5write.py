"""Closing HDF5 files that are being written, in the order a full disk needs.

Why h5py's close fails after ENOSPC, and then the process crashes: ``h5py.File.close`` first closes
every object still open in the file (``_close_open_objects``: the datasets), and closing a dataset
or the file makes HDF5 write what it still holds in memory: a contiguous dataset's sieve buffer (up
to 64 KiB of raw data) and the metadata cache (object headers, the superblock). On a full disk those
writes fail again, so the close raises (``RuntimeError: Can't decrement id ref count``) with its
identifiers half released; HDF5 then walks them once more when Python drops the objects or when the
library shuts down at exit, and the process dies with a segmentation fault (exit 139). A second
close of the same file crashes the same way: once a close has failed nothing can be recovered.

So a writer closes in this order: :func:`close_all` flushes every file first (``H5Fflush`` writes
the buffers while every identifier stays valid; a full disk fails here, harmlessly); only when the
flushes succeeded does it close them. A file whose write or flush failed is abandoned
(:func:`abandon`): its descriptor is pointed (``dup2``) at an anonymous in-memory file
(``memfd_create``), so that whatever HDF5 still writes while closing succeeds and goes nowhere, and
then it is closed; the caller removes the partial file (it lives under a temporary name).

A writer also keeps every dataset it creates referenced until the file is closed: a dataset dropped
while the file is open is closed at once, and that close writes its sieve buffer too; on a full disk
it fails inside Python's deallocation (``Exception ignored in ObjectID.__dealloc__``), where nothing
can catch it, and leaves the same half-released identifiers behind (the token store's crash in
``PrepareCorpus``, found by scripts/reliability.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterable, Iterator

import h5py


def abandon(files: Iterable[h5py.File]) -> None:
    """Close ``files`` (open for writing; their content is given up) without any write reaching the
    disk: each file's descriptor is replaced by an in-memory file first, so the close cannot fail on
    a full disk and leaves no half-released identifier behind (see the module docstring). Never
    raises; a file already closed is skipped."""
    for f in files:
        try:
            if not f.id.valid:
                continue
            fd = f.id.get_vfd_handle()
            if isinstance(fd, int) and fd >= 0 and hasattr(os, "memfd_create"):
                sink = os.memfd_create("zerograph-abandoned-h5")
                os.dup2(sink, fd)
                os.close(sink)
            else:  # another driver, or no memfd: the file's own blocks are all HDF5 can write into
                with contextlib.suppress(OSError):
                    os.truncate(f.filename, 0)
            f.close()
        except Exception:  # noqa: BLE001 (given up: nothing of it is kept)
            pass


def close_all(files: Iterable[h5py.File]) -> None:
    """Flush every one of ``files``, then close them (see the module docstring). A flush that fails
    (a full disk: h5py's ``RuntimeError``) abandons every file (:func:`abandon`) and raises an
    ``OSError`` with the failure's errno (ENOSPC when HDF5 names it) from it.

    Raises:
        OSError: a flush failed; the files are closed and their content is given up."""
    files = list(files)
    names = [f.filename for f in files]  # asked before: a closed file's name is not to be asked (h5py crashes)
    flushing = None
    try:
        for name, f in zip(names, files):
            flushing = name
            f.flush()
    except Exception as e:
        abandon(files)
        if isinstance(e, OSError):
            raise
        text = str(e)
        code = (
            errno.EDQUOT if f"errno = {errno.EDQUOT}," in text else errno.ENOSPC if "errno = 28," in text else errno.EIO
        )
        raise OSError(code, f"HDF5 could not flush {flushing}: {text.splitlines()[0]}") from e
    for f in files:
        f.close()


@contextlib.contextmanager
def writing(path: str | os.PathLike, mode: str = "w") -> Iterator[h5py.File]:
    """``h5py.File(path, mode)`` for writing, closed by :func:`close_all` when the block ends, or
    abandoned (:func:`abandon`) when it raises; the block's error is re-raised."""
    f = h5py.File(path, mode)
    try:
        yield f
    except BaseException:
        abandon([f])
        raise
    close_all([f])
