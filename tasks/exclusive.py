"""One build of a task at a time across the runs that share an outputs folder.

Two ``--local-scheduler`` runs (or two identical commands, or workers of different luigid
schedulers) whose graphs share a task each schedule it, since neither sees the other. Each task's
run therefore holds an exclusive lock on ``<outputs>/.locks/<Family>/<label>-<hash>.lock`` (``flock``,
:func:`zgcore.atomic.exclusive`): the second run of the same task waits for the first and, once the
first has finished it and its output is whole (:meth:`tasks.base.ZGTask.check_output`), counts it as
done and goes on without building it again. A first run that failed leaves the lock free and the
second builds the task itself. The lock file is removed when the task is done. Where the file system
offers no locks, two runs may build the same task; the second to finish keeps the first's output when
it is whole (:meth:`tasks.base.ZGTask.building`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from zgcore.atomic import exclusive


def lock_path(task) -> Path:
    """The lock file of ``task``'s build: ``<outputs>/.locks/<Family>/<folder name>.lock``, outside the
    family's folder, so a lock a killed or failed run leaves holds nothing a reader of outputs meets."""
    return task.out_dir.parent.parent / ".locks" / task.out_dir.parent.name / f"{task.out_dir.name}.lock"


def finished_elsewhere(task) -> bool:
    """Whether ``task``'s output folder exists and is whole and current (what another run left)."""
    return task.out_dir.is_dir() and task.check_output() is None


@contextlib.contextmanager
def alone(task) -> Iterator[bool]:
    """Hold ``task``'s build lock for the block; yields ``True`` when another run finished the task
    while this one waited (then the block must not build it). Removes the lock file when the block
    ends with the task done."""
    lock = lock_path(task)
    with exclusive(lock, lambda: task.log(f"waiting for another run that is building this task ({lock})")) as held:
        task._alone = True
        try:
            if held and finished_elsewhere(task):
                task.log(f"built by another run meanwhile; its output {task.out_dir} is whole and is kept")
                yield True
            else:
                yield False
            if held and task.out_dir.is_dir():
                lock.unlink(missing_ok=True)
        finally:
            task._alone = False


def alone_generator(task, body: Callable[..., Any], args, kwargs):
    """:func:`alone` around a ``run`` that yields dynamic dependencies (a generator): the lock is
    held while the generator runs, and dropped when Luigi sets it aside to run what it yielded."""
    with alone(task) as done:
        if done:
            return None
        return (yield from body(task, *args, **kwargs))
