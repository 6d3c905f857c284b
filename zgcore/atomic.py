"""Atomic outputs: write under a temporary name in the same folder, then ``os.replace``; and the
removal of temporary names whose writer died (killed, node lost) before renaming them.

A partial file or folder never carries the final name, so an interrupted run never counts as
complete. What is renamed into place carries the permissions of the user's umask (group- and
world-readable under the usual 022), like any other tool's output: safetensors >= 0.8 writes
through a ``tempfile`` that is always created 0600 (safetensors#764, #782), and so do
``save_file`` and every ``save_pretrained`` that uses it.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

from zgcore.hashing import canonical

# A temporary file or folder written on another host (whose process cannot be checked from here)
# is a dead writer's once nothing in it changed for this long.
STALE_AFTER_S = 24 * 3600.0


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


def this_host() -> str:
    """This host's name as written into temporary names (``socket.gethostname()``, ``/`` replaced)."""
    return socket.gethostname().replace("/", "_") or "unknown"


def tmp_sibling(path: Path) -> Path:
    """A unique temporary path beside ``path`` (same filesystem, so rename is atomic):
    ``.<name>.tmp-<host>-<pid>-<8 hex>``, naming its writer so that :func:`remove_stale_temps` can
    tell a dead writer's leftovers from a live one's."""
    return path.with_name(f".{path.name}.tmp-{this_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def temp_writer(name: str) -> tuple[str | None, int] | None:
    """``(host, pid)`` of the writer of a temporary name made by :func:`tmp_sibling` (host ``None``
    for names written before the host was recorded: ``.<name>.tmp-<pid>-<hex>``); ``None`` when
    ``name`` is not such a name."""
    at = name.rfind(".tmp-")
    if not name.startswith(".") or at < 1:
        return None
    parts = name[at + 5:].rsplit("-", 2)
    if len(parts) == 2 and parts[0].isdigit():
        return None, int(parts[0])
    if len(parts) == 3 and parts[1].isdigit() and parts[0]:
        return parts[0], int(parts[1])
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _newest_mtime(path: Path) -> float:
    """The latest modification time of ``path`` and, for a folder, of anything in it (a writer
    filling a file keeps this recent); 0 when it vanished meanwhile."""
    newest = 0.0
    for p in [path, *(path.rglob("*") if path.is_dir() else ())]:
        try:
            newest = max(newest, p.lstat().st_mtime)
        except OSError:
            pass
    return newest


def is_stale(path: Path, max_age_s: float = STALE_AFTER_S, now: float | None = None) -> bool:
    """Whether ``path`` is a temporary file or folder (:func:`tmp_sibling`) whose writer is gone: on
    this host, its process no longer exists; written elsewhere (or by code that did not record the
    host), nothing in it changed for ``max_age_s`` seconds. A reused pid keeps a leftover until the
    next check; a live writer is never judged stale on its own host."""
    who = temp_writer(path.name)
    if who is None:
        return False
    host, pid = who
    if host == this_host():
        return not _alive(pid)
    return (now if now is not None else time.time()) - _newest_mtime(path) > max_age_s


def remove_stale_temps(folder: str | os.PathLike, prefix: str | None = None,
                       max_age_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove the stale temporary files and folders (:func:`is_stale`) directly in ``folder``
    (only those of final name ``prefix`` when given); returns what was removed. A folder that cannot
    be listed removes nothing."""
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for p in entries:
        if (prefix is None or p.name.startswith(f".{prefix}.tmp-")) and is_stale(p, max_age_s):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            removed.append(p)
    return removed


# Folders, relative to the outputs root, where code writes temporaries outside a task's own folder
# and its work folder (e.g. the teacher cache, ``teachers``): every task sweeps them for dead
# writers' leftovers when it starts (:func:`remove_registered_temps`). A module that writes under a
# new such folder registers it when imported (:func:`register_temp_root`).
TEMP_ROOTS: list[str] = []


def register_temp_root(relative: str) -> str:
    """Declare ``relative`` (a folder under the outputs root, e.g. ``"teachers"``) as a place where
    temporaries are written; returns it. Idempotent. Raises ``ValueError`` for an absolute path or
    one that leaves the outputs root."""
    rel = Path(relative)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise ValueError(f"a temp root is a folder below the outputs root, got {relative!r}")
    if str(rel) not in TEMP_ROOTS:
        TEMP_ROOTS.append(str(rel))
    return str(rel)


def remove_registered_temps(outputs: str | os.PathLike, max_age_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove the stale temporaries (:func:`is_stale`) in every registered temp root under
    ``outputs`` and in each folder directly below it (a cache keeps one folder per entry); returns them."""
    removed: list[Path] = []
    for rel in TEMP_ROOTS:
        root = Path(outputs) / rel
        removed += remove_stale_temps(root, max_age_s=max_age_s)
        try:
            subs = [p for p in root.iterdir() if p.is_dir() and temp_writer(p.name) is None]
        except OSError:
            continue
        for sub in subs:
            removed += remove_stale_temps(sub, max_age_s=max_age_s)
    return removed


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path; on success rename it to ``path``, on error remove it.

    Before it starts, the temporaries of ``path``'s own name whose writers died
    (:func:`remove_stale_temps`) are removed: whoever writes a path again cleans up after a killed
    writer of it, wherever that path is. Works for files and folders; the result gets the umask's
    permissions (:func:`umask_permissions`). Raises ``FileExistsError`` if ``path`` is a non-empty
    folder created meanwhile by someone else (the other writer wins; nothing is overwritten), and
    :class:`NoSpaceError` when the file system ran out of space or quota while anything inside the
    block wrote (:func:`is_no_space`); the temporary is removed either way.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise_no_space(e, path)
        raise
    remove_stale_temps(path.parent, path.name)
    tmp = tmp_sibling(path)
    try:
        yield tmp
        if path.is_dir() and tmp.is_dir():
            raise FileExistsError(f"{path} was completed by another writer")
        if tmp.exists():
            umask_permissions(tmp)
        try:
            os.replace(tmp, path)
        except OSError as e:  # a folder that another writer renamed into place since the check above
            if tmp.is_dir() and e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise FileExistsError(f"{path} was completed by another writer") from e
            raise
    except Exception as e:
        raise_no_space(e, path, tmp)
        raise
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How writers that drop the errno say it: HDF5's error stack (h5py), safetensors' Rust io::Error, the C library.
_NO_SPACE_WORDS = ("no space left on device", "disk quota exceeded", "errno = 28,", f"errno = {errno.EDQUOT},",
                   "(os error 28)", f"(os error {errno.EDQUOT})", "storagefull", "quotaexceeded")
# What torch.save says when its stream fails (no errno, no words): taken as out of space when the folder's file
# system has less than FULL_BELOW bytes free at that moment.
_OPAQUE_WRITE_WORDS = ("iostream error", "unexpected pos", "pytorchstreamwriter failed", "file write failed")
FULL_BELOW = 1 << 20


class NoSpaceError(OSError):
    """A write that found no space left (ENOSPC) or the user's quota used up (EDQUOT). The message is
    one line naming what was being written, how much it had written, the file system and what it
    has free, and what to do (free space, rerun: the same command resumes). ``errno`` is ``ENOSPC``."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.strerror)


def _chain(e: BaseException | None) -> Iterator[BaseException]:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def free_bytes(path: str | os.PathLike) -> tuple[int, int] | None:
    """``(free, total)`` bytes of the file system holding ``path`` (or its nearest existing parent),
    as an unprivileged user sees them (``statvfs``'s ``f_bavail``); ``None`` when it cannot be asked."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def mount_point(path: str | os.PathLike) -> Path:
    """The mount point of the file system holding ``path`` (or its nearest existing parent)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def is_no_space(e: BaseException, path: str | os.PathLike | None = None) -> bool:
    """Whether ``e`` (or an exception it was raised from or during) is a write that ran out of space
    or quota: an ``OSError`` with errno ENOSPC or EDQUOT, a message that says so (h5py's
    ``RuntimeError``, safetensors' ``SafetensorError``), or a failed torch stream (``iostream error``,
    ``unexpected pos``) while the file system of ``path`` has under :data:`FULL_BELOW` bytes free."""
    for x in _chain(e):
        if isinstance(x, NoSpaceError):
            return True
        if isinstance(x, OSError) and x.errno in NO_SPACE_ERRNOS:
            return True
        text = str(x).lower()
        if any(w in text for w in _NO_SPACE_WORDS):
            return True
    if path is not None and any(w in str(x).lower() for x in _chain(e) for w in _OPAQUE_WRITE_WORDS):
        free = free_bytes(path)
        return free is not None and free[0] < FULL_BELOW
    return False


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _size(p: Path | None) -> int:
    if p is None or not p.exists():
        return 0
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def raise_no_space(e: BaseException, path: str | os.PathLike, tmp: Path | None = None,
                   need: int | None = None) -> None:
    """Raise :class:`NoSpaceError` from ``e`` when it is a write out of space (:func:`is_no_space`),
    naming ``path``, what ``tmp`` (its partial output) had written or ``need`` (the bytes the write
    needs, when known), the file system and its free space; return (to let the caller re-raise ``e``)
    otherwise, and at once when ``e`` already is one."""
    if isinstance(e, NoSpaceError) or not is_no_space(e, path):
        return
    quota = any(isinstance(x, OSError) and x.errno == errno.EDQUOT or "quota" in str(x).lower() for x in _chain(e))
    free = free_bytes(path)
    wrote = _size(tmp)
    needs = f"needs {_mib(need)}" if need else f"needed more than the {_mib(wrote)} it had written"
    has = f"{mount_point(path)} has {_mib(free[0])} free of {_mib(free[1])}" if free else "its file system"
    what = "disk quota exceeded" if quota else "no space left on device"
    raise NoSpaceError(f"{what} writing {path}: it {needs}; {has}; the partial output was removed: free space "
                       f"(or give --outputs a bigger folder) and rerun the same command, it resumes "
                       f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})") from e


@contextlib.contextmanager
def exclusive(lock: str | os.PathLike, waiting: Callable[[], None] | None = None) -> Iterator[bool]:
    """Hold an exclusive lock (``flock``) on the file ``lock`` (created if missing) for the block;
    yields ``True`` when the lock is held. Another process holding it makes this wait, calling
    ``waiting()`` once first. Where the file system offers no locks (or the file cannot be created:
    a read-only folder) it yields ``False`` at once and nothing is held. Released when the block
    ends, also when the process dies (the kernel drops it)."""
    lock = Path(lock)
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = True
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = True
        except OSError:  # ENOLCK, EOPNOTSUPP: no locks on this file system
            held = False
        yield held
    finally:
        os.close(fd)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented, canonical JSON to ``path`` atomically (NaN/inf become ``null``)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(canonical(obj, nonfinite="null"), indent=2, sort_keys=True) + "\n")


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def aside_name(path, kind: str = "damaged") -> Path:
    """A free sibling name for ``path`` set aside: ``<name>.<kind>-<unix time>``, with ``-2``,
    ``-3``... appended when a file or folder of that name already exists (the same file damaged
    twice within one second would otherwise be renamed onto its first copy: a folder rename then
    fails, a file rename silently replaces the first copy)."""
    import time

    path = Path(path)
    base = f"{path.name}.{kind}-{int(time.time())}"
    dest, n = path.with_name(base), 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{base}-{n}")
    return dest


def set_aside(path, kind: str = "damaged") -> Path | None:
    """Rename the file or folder ``path`` to :func:`aside_name` (kept for inspection, never
    deleted); returns the new path, or None when it could not be renamed (already gone, or the file
    system refused)."""
    dest = aside_name(path, kind)
    try:
        Path(path).rename(dest)
    except OSError:
        return None
    return dest
