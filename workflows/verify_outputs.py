"""What ``zerograph verify`` checks of the task outputs themselves, and what ``--clean`` removes.

* :func:`task_outputs` (a checker of :data:`workflows.verify.CHECKERS`): every file of every
  finished task output whose ``task.json`` records its SHA-256 (block weights, the assembled
  model's files, reports, logit and token stores, study inputs, ...), read in full and compared
  with it — not through the per-process cache ``complete()`` uses. A damaged output is moved aside
  (``<folder>.damaged-<time>-<id>``) so that the next run rebuilds that task.
* :func:`clean_leftovers`: every temporary name under the outputs folder whose writer is gone
  (:func:`zgcore.atomic.is_stale`), removed.
* :func:`set_aside`: what ``zerograph clean`` lists and removes: outputs moved aside as stale or
  damaged, and dead writers' temporary names.

:class:`Item`, the unit every checker of :data:`workflows.verify.CHECKERS` returns, lives here so
that the two modules import one way (verify -> verify_outputs).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from collections.abc import Callable, Sequence

from zgcore.atomic import STALE_AFTER_S, is_stale, remove_stale_temps, temp_writer

if TYPE_CHECKING:
    from tasks import ZGTask

Problem = tuple[Path, str]
# a folder's suffix from tasks.base.ZGTask.move_aside (<time>: 20261203-190405), or a file's from the stores (unix time)
SET_ASIDE = re.compile(r"\.(stale|damaged)-\d{8}")


@dataclass(frozen=True)
class Item:
    """One thing :func:`workflows.verify.verify` checks.

    Attributes:
        what: names it in messages (e.g. ``"boundary shard <folder>"``).
        nbytes: bytes it reads (the progress bar's share; 0 if unknown).
        check: ``check(progress)`` checks it, calling ``progress(bytes)`` as it reads, moves what is
            damaged aside, and returns ``(path, what is wrong)`` per damaged file (``[]``: whole).
        folder: the output folder it checks (a task's, a shard's), when it checks one.
    """
    what: str
    nbytes: int
    check: Callable[[Callable[[int], None]], list[Problem]]
    folder: Path | None = None


def _sha256(path: Path, progress: Callable[[int], None], chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            progress(len(block))
    return h.hexdigest()


def check_task_output(t: ZGTask, rec: dict, progress: Callable[[int], None]) -> list[Problem]:
    """Compare each file ``rec`` (``t``'s ``task.json``) records a SHA-256 for with its bytes now; at
    the first that is missing, cut short or changed, move ``t``'s folder aside and return it as the
    problem. A file the file system cannot read is reported and kept (that is not damage)."""
    for name, want in rec["sha256"].items():
        f = t.out_dir / name
        if not f.is_file() and list(f.parent.glob(f"{f.name}.damaged-*")):
            continue  # moved aside a moment ago by the checker of its own kind (a store's statistics file)
        try:
            if not f.is_file():
                why = "missing"
            elif f.stat().st_size != rec["files"].get(name):
                why = f"{f.stat().st_size} bytes, {rec['files'].get(name)} when written"
            else:
                why = None if _sha256(f, progress) == want else "its bytes differ from the SHA-256 recorded when it was written"
        except OSError as e:
            return [(f, f"could not be read ({e}); kept: check again when the file system answers")]
        if why:
            moved = t.move_aside("damaged")
            return [(f, (f"{why}; moved the output aside to {moved}, the next run rebuilds {t.get_task_family()} "
                         f"{t.label()}"))]
    return []


def task_outputs(tasks: Sequence[ZGTask]) -> list[Item]:
    """One item per finished output among ``tasks`` whose ``task.json`` records content hashes."""
    items = []
    for t in tasks:
        rec = t.record() if t.out_dir.is_dir() else None
        if not rec or not rec.get("sha256"):
            continue
        size = sum(int(rec["files"].get(name, 0)) for name in rec["sha256"])
        items.append(Item(f"{t.title()} {t.out_dir}", size,
                          lambda progress, t=t, rec=rec: check_task_output(t, rec, progress), folder=t.out_dir))
    return items


def clean_leftovers(outputs: str | os.PathLike, max_age_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove every temporary file or folder under ``outputs`` whose writer is gone (this host:
    its process no longer exists; another host: unchanged for ``max_age_s``); returns them."""
    removed: list[Path] = []
    for folder, dirs, _ in os.walk(outputs):
        gone = remove_stale_temps(folder, max_age_s=max_age_s)
        removed += gone
        dirs[:] = [d for d in dirs if Path(folder, d) not in gone]
    return removed


def _size(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() or p.is_symlink())


def set_aside(outputs: str | os.PathLike, max_age_s: float = STALE_AFTER_S) -> list[tuple[Path, str, int]]:
    """What ``zerograph clean`` lists under ``outputs``: ``(path, kind, bytes)`` for every output moved
    aside (kind ``stale`` or ``damaged``: ``<folder>.stale-<time>-<id>``, ``<folder>.damaged-<time>-<id>``,
    a statistics file ``<file>.damaged-*``) and every temporary name whose writer is gone (kind
    ``temporary``, :func:`zgcore.atomic.is_stale`). A live writer's temporary name, a ``.partial`` work
    folder and every finished output are never listed. Sorted by path; ``[]`` when ``outputs`` does
    not exist."""
    found: list[tuple[Path, str, int]] = []
    for folder, dirs, files in os.walk(outputs):
        keep = []
        for name in [*dirs, *files]:
            p = Path(folder, name)
            m = SET_ASIDE.search(name)
            kind = m.group(1) if m else ("temporary" if temp_writer(name) and is_stale(p, max_age_s) else None)
            if kind:
                found.append((p, kind, _size(p)))
            elif name in dirs:
                keep.append(name)
        dirs[:] = keep
    return sorted(found)


def remove_set_aside(paths: Sequence[Path]) -> None:
    """Remove each file or folder of ``paths`` (what :func:`set_aside` listed)."""
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
