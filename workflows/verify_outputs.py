"""What ``zerograph verify`` checks of the task outputs themselves, and what ``--clean`` removes.

* :func:`task_outputs` (a checker of :data:`workflows.verify.CHECKERS`): every file of every
  finished task output whose ``task.json`` records its SHA-256 (block weights, the assembled
  model's files, reports, logit and token stores, study inputs, ...), read in full and compared
  with it — not through the per-process cache ``complete()`` uses. A damaged output is moved aside
  (``<folder>.damaged-<time>-<id>``) so that the next run rebuilds that task.
* :func:`clean_leftovers`: every temporary name under the outputs folder whose writer is gone
  (:func:`zgcore.atomic.is_stale`), removed.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable, Sequence

from tasks import ZGTask
from zgcore.atomic import STALE_AFTER_S, remove_stale_temps

from .verify import Item, Problem


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
                          lambda progress, t=t, rec=rec: check_task_output(t, rec, progress)))
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
