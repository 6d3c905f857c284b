"""``zerograph verify``: check every byte of an experiment's stored artefacts that a run does not
check in full when it reads them, and move each damaged one aside so that the next run rebuilds it.

A run checks what it reads as it reads it (a boundary shard's metadata when the file is opened,
each sequence's bytes when read), so that start-up does not grow with the store; this command is
the whole-file check, run when wanted (after copying a store, on a schedule, before a long run).

Extending it: a *checker* is a function from the experiment's tasks to the :class:`Item` s it
checks; add one to :data:`CHECKERS`. Each item names what it checks, its size in bytes (for the
progress bar) and a ``check(progress)`` that returns ``(path, what is wrong)`` per damaged file.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING
from collections.abc import Callable, Iterable, Sequence

from zgcore.progress import LogLines, progress_bar

from .verify_outputs import Item, Problem, task_outputs

if TYPE_CHECKING:
    from tasks import ZGTask

__all__ = ["Item", "Problem", "Checker", "CHECKERS", "boundary_stores", "task_outputs", "verify"]

Checker = Callable[[Sequence["ZGTask"]], list[Item]]


def boundary_stores(tasks: Sequence[ZGTask]) -> list[Item]:
    """Every shard of every boundary store and top-k logit store among ``tasks`` (the shards a join's manifest lists, and
    built shards not yet joined), each file against its whole-file SHA-256; and each join's
    statistics files. A shard shared by several joins is checked once."""
    from tasks.cache import _JoinTask as TeacherBoundary, _ShardTask as BoundaryShard  # boundary and top-k logit stores
    from zgcore.data.boundary_store import MANIFEST, SHARD_FILE, read_shard_record
    from zgcore.data.boundary_store.integrity import check_shard, check_stats, store_shards

    shards: dict[Path, dict] = {}
    items: list[Item] = []
    for t in tasks:
        if isinstance(t, TeacherBoundary) and (t.out_dir / MANIFEST).is_file():
            for folder, files in store_shards(t.out_dir):
                shards.setdefault(folder, files)
            root = t.out_dir
            items.append(Item(f"boundary statistics {root}", sum(p.stat().st_size for p in root.glob("stats-b*.npy")),
                              lambda progress, root=root: check_stats(root, progress), folder=root))
        elif isinstance(t, BoundaryShard) and (t.out_dir / SHARD_FILE).is_file():
            shards.setdefault(t.out_dir.resolve(), read_shard_record(t.out_dir)["files"])
    for folder, files in shards.items():
        if not folder.is_dir():  # already moved aside, or never built: the next run builds it
            continue
        size = sum((folder / e["name"]).stat().st_size for e in files.values() if (folder / e["name"]).is_file())
        items.insert(0, Item(f"boundary shard {folder}", size,
                             lambda progress, folder=folder, files=files: check_shard(folder, files, progress), folder=folder))
    return items


# what `zerograph verify` checks, in order; each entry maps the experiment's tasks to items
CHECKERS: list[Checker] = [boundary_stores, task_outputs]  # task_outputs: every finished output against its task.json


def verify(tasks: Sequence[ZGTask], checkers: Iterable[Checker] | None = None,
           bar: bool = True) -> tuple[list[Item], list[Problem]]:
    """Run every item of every checker (default :data:`CHECKERS`, read when called) over ``tasks``
    under one progress display of bytes (:func:`zgcore.progress.progress_bar`: a bar on a terminal,
    a few plain lines elsewhere; none when ``bar`` is false).
    Returns ``(items checked, problems)``; a problem is ``(damaged file, what is wrong and where it
    was moved)``."""
    items = [item for c in (CHECKERS if checkers is None else checkers) for item in c(tasks)]
    problems: list[Problem] = []
    total = sum(i.nbytes for i in items)
    pb = progress_bar(total, "verify", "B", unit_scale=True) if bar else LogLines(total, interval_s=float("inf"))
    with pb:
        for item in items:
            problems += item.check(pb.update)
    return items, problems
