"""How a ``luigi --module workflows ...`` command ends: an exit code a batch system can trust, the
report's path as the last line of every run, and one line after Ctrl-C.

Luigi's ``luigi`` command (``luigi.retcodes.run_with_retcodes``) picks its exit code from what this
worker saw: a task that luigid gave to another worker counts as ``already_running`` (10) or, when the
worker never saw it run, ``not_run`` (25, "not granted run permission") — so every worker that shared
an experiment exits non-zero although the experiment is complete. It offers no hook at the end of a
run, so :func:`install` wraps ``luigi.interface._run`` (the call ``run_with_retcodes`` makes, looked
up at call time) for workflows of this package only:

* when the workflow is complete at the end and no task failed or could not be scheduled in this
  worker, the command exits 0 whatever else the worker saw; otherwise Luigi's own code stands
  (``[retcode]``, :data:`workflows.RETCODES`), so it is non-zero exactly when something failed or is
  not done;
* the report's path is printed after Luigi's summary, also on a rerun that had nothing to do;
* Ctrl-C (``KeyboardInterrupt``) prints :data:`INTERRUPTED` on stderr instead of a traceback and
  exits :data:`INTERRUPTED_EXIT` (128 + SIGINT, what a shell reports for a command it interrupted).
"""
from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path

import luigi
import luigi.execution_summary
import luigi.interface
import luigi.retcodes

INTERRUPTED = "interrupted; rerun the same command to resume from the last checkpoint"
INTERRUPTED_EXIT = 130
_MAIN_PID = os.getpid()


def report_path(root: luigi.Task) -> Path | None:
    """The ``report.md`` a workflow's run ends with, when it exists (``None`` for workflows without a
    report, e.g. ``PrepareInputs``, and before the report is built)."""
    for t in luigi.task.flatten(root.requires()):
        p = Path(getattr(t, "out_dir", "")) / "report.md"
        if getattr(t, "out_dir", None) is not None and p.is_file():
            return p
    return None


def finish(result) -> None:
    """After Luigi's run of a workflow of this package: print the report's path and exit 0 when the
    workflow is complete and nothing failed in this worker; return (Luigi then picks its code) otherwise."""
    from .experiment import ConfiguredWorkflow

    worker = result.worker
    root = luigi.execution_summary._root_task(worker)
    if not isinstance(root, ConfiguredWorkflow):
        return
    sets = luigi.execution_summary._summary_dict(worker)
    path = report_path(root)
    if path is not None:
        print(f"Report: {path}", flush=True)
    if not sets["failed"] and not sets["scheduling_error"] and root.complete():
        sys.stdout.flush()
        sys.exit(0)


def _quiet_sigint_in_task_processes(task) -> None:
    """In a task process forked by ``--workers N``, ignore SIGINT: the parent handles Ctrl-C and
    terminates its task processes (Luigi's ``Worker.__exit__``), so they print no traceback of their own."""
    if os.getpid() != _MAIN_PID:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def install() -> None:
    """Wrap ``luigi.interface._run`` once (see the module docstring). Idempotent."""
    if getattr(luigi.interface._run, "_zerograph", False):
        return
    original = luigi.interface._run

    @functools.wraps(original)
    def _run(*args, **kwargs):
        # only the `luigi` command's own call; luigi.run() from Python keeps Luigi's behaviour
        if sys._getframe(1).f_code is not luigi.retcodes.run_with_retcodes.__code__:
            return original(*args, **kwargs)
        try:
            result = original(*args, **kwargs)
        except KeyboardInterrupt:
            sys.stdout.flush()
            print(f"\n{INTERRUPTED}", file=sys.stderr, flush=True)
            sys.exit(INTERRUPTED_EXIT)
        finish(result)
        return result

    _run._zerograph = True
    luigi.interface._run = _run
    luigi.Task.event_handler(luigi.Event.START)(_quiet_sigint_in_task_processes)
