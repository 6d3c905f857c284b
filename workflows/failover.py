"""A lost worker is replaced, a task that raises fails once: how ZeroGraph's workers report a failure.

Luigi's scheduler fails a task in two ways, and counts both alike against the task's
``retry_count``: a worker reports that the task raised, or the scheduler stops hearing from the
worker running it (``[scheduler] worker_disconnect_delay``, 60 s by default: the job was killed,
preempted, its node lost) and fails it itself (``fail_dead_worker_task``). A failed task returns to
PENDING ``retry_delay`` seconds later and any live worker that scheduled it takes it — so with
``ZGTask.retry_count = 3`` a lost worker's task goes to a survivor, which resumes it from its
checkpoints (``<folder>.partial``), and a task whose worker is lost three times within
``disable_window`` (an hour) is disabled. Luigi has no setting that tells the two apart, so a task
that raised would be retried the same way. :func:`install` therefore makes every worker follow
its report that a ZeroGraph task failed with a second one, status ``DISABLED`` (a worker's own
disable, which the scheduler never lifts by itself after ``disable_persist``, unlike its own):
the task is not retried, the workers waiting on it stop at once (exit 10 or 25, the failing one
30), and a rerun's worker, which reports it PENDING again, enables it again at once.
"""
from __future__ import annotations

import functools

import luigi.worker
from luigi.scheduler import DISABLED, FAILED


def install() -> None:
    """Wrap ``luigi.worker.Worker._add_task`` once (see the module docstring). Idempotent."""
    if getattr(luigi.worker.Worker._add_task, "_zerograph", False):
        return
    original = luigi.worker.Worker._add_task

    @functools.wraps(original)
    def _add_task(self, *args, **kwargs):
        original(self, *args, **kwargs)
        from tasks.base import ZGTask

        if kwargs.get("status") == FAILED and isinstance(self._scheduled_tasks.get(kwargs.get("task_id")), ZGTask):
            # the same report (resources, retry policy, explanation) as DISABLED: no retry of a raised error
            self._scheduler.add_task(*args, **{**kwargs, "status": DISABLED, "runnable": False, "new_deps": None})

    _add_task._zerograph = True
    luigi.worker.Worker._add_task = _add_task
