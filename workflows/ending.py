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
  exits :data:`INTERRUPTED_EXIT` (128 + SIGINT, what a shell reports for a command it interrupted);
* SIGTERM (how Slurm pre-empts or cancels a job, and ``kill``'s default) ends the run the same way:
  the task stops where it is, its checkpoints stay in ``<folder>.partial``, :data:`TERMINATED` is
  printed and the command exits :data:`TERMINATED_EXIT` (128 + SIGTERM); the same command resumes;
* before any task runs, the pre-flight (:func:`check_plan`): the plan's disk and memory needs against
  what is free; a task that cannot fit ends the command with one line and exit :data:`PREFLIGHT_EXIT`;
* without ``--local-scheduler``, a scheduler (luigid) that does not answer within
  :data:`SCHEDULER_TIMEOUT_S` ends the command at once with one line naming both fixes, exit
  :data:`NO_SCHEDULER_EXIT`, instead of Luigi's minute of retries and a traceback.
"""
from __future__ import annotations

import functools
import os
import signal
import socket
import sys
import urllib.parse
from pathlib import Path

import luigi
import luigi.execution_summary
import luigi.interface
import luigi.retcodes

INTERRUPTED = "interrupted; rerun the same command to resume from the last checkpoint"
INTERRUPTED_EXIT = 130
TERMINATED = "terminated (SIGTERM); rerun the same command to resume from the last checkpoint"
TERMINATED_EXIT = 143
NO_SCHEDULER_EXIT = 2  # as a configuration error: nothing ran
SCHEDULER_TIMEOUT_S = 3.0
PREFLIGHT_EXIT = 2  # as a configuration error: nothing ran
_MAIN_PID = os.getpid()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread of the ``luigi`` command's process: it unwinds the run
    as Ctrl-C does (Luigi stops its task processes, the task's checkpoints stay)."""


def _on_sigterm(signum, frame) -> None:
    import multiprocessing

    if os.getpid() == _MAIN_PID:
        raise Terminated()
    if multiprocessing.current_process().name.startswith("zerograph-prefetch"):
        return  # a prefetch worker: its training process stops it, as on Ctrl-C (zgcore/data/process_workers.py)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a Luigi task process (--workers N): end as before
    os.kill(os.getpid(), signal.SIGTERM)


def scheduler_problem(cmdline_args) -> str | None:
    """One line saying that no luigid answers where this command would look for one, naming both
    fixes; ``None`` with ``--local-scheduler``, or when it answers (a TCP connection within
    :data:`SCHEDULER_TIMEOUT_S`), or for an address that is not ``http(s)`` (not checked)."""
    from luigi.cmdline_parser import CmdlineParser

    with CmdlineParser.global_instance(list(cmdline_args)):
        env = luigi.interface.core()
    if env.local_scheduler:
        return None
    url = env.scheduler_url or f"http://{env.scheduler_host}:{env.scheduler_port}"
    u = urllib.parse.urlparse(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        return None
    try:
        socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)),
                                 timeout=SCHEDULER_TIMEOUT_S).close()
        return None
    except OSError as e:
        return (f"error: no Luigi scheduler answers at {url} ({e.strerror or e}): add --local-scheduler to run on this "
                "machine alone, or start luigid (`luigid --background`) or set [core] default-scheduler-url in "
                "luigi.cfg to one that runs (nothing ran)")


def check_plan(cmdline_args) -> None:
    """The pre-flight (:func:`workflows.plan.preflight`) of the workflow on the command line, before
    any task runs: on a task that cannot fit, one ``error:`` line and exit :data:`PREFLIGHT_EXIT`.
    ``ZG_PREFLIGHT=0`` skips it; a graph the plan cannot read is run unchecked, with one line saying why."""
    from luigi.cmdline_parser import CmdlineParser

    from .experiment import ConfiguredWorkflow
    from .plan import PREFLIGHT_ENV, preflight

    if os.environ.get(PREFLIGHT_ENV, "1") == "0":
        return
    with CmdlineParser.global_instance(list(cmdline_args)) as cp:
        root = cp.get_task_obj()
        if not isinstance(root, ConfiguredWorkflow):
            return
        try:
            problem = preflight(root)
        except Exception as e:  # noqa: BLE001 (a plan that cannot be made never stops a run)
            print(f"pre-flight skipped ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
            return
    if problem:
        print(f"error: {problem} (nothing ran; {PREFLIGHT_ENV}=0 skips this check)", file=sys.stderr, flush=True)
        sys.exit(PREFLIGHT_EXIT)


def report_path(root: luigi.Task) -> Path | None:
    """The report a workflow's run ends with (its :mod:`workflows.registry` entry's ``report``, else
    ``report.md``), when it exists (``None`` for workflows without a report, e.g. ``PrepareInputs``,
    and before the report is built)."""
    from . import registry

    name = registry.get(root.get_task_family()).report if root.get_task_family() in registry.names() else "report.md"
    for t in luigi.task.flatten(root.requires()):
        p = Path(getattr(t, "out_dir", "")) / name
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
        argv = args[0] if args else kwargs.get("cmdline_args")
        problem = scheduler_problem(sys.argv[1:] if argv is None else argv)
        if problem:
            print(problem, file=sys.stderr, flush=True)
            sys.exit(NO_SCHEDULER_EXIT)
        check_plan(sys.argv[1:] if argv is None else argv)
        signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            result = original(*args, **kwargs)
        except KeyboardInterrupt as e:
            sys.stdout.flush()
            terminated = isinstance(e, Terminated)
            print(f"\n{TERMINATED if terminated else INTERRUPTED}", file=sys.stderr, flush=True)
            sys.exit(TERMINATED_EXIT if terminated else INTERRUPTED_EXIT)
        finish(result)
        return result

    _run._zerograph = True
    luigi.interface._run = _run
    luigi.Task.event_handler(luigi.Event.START)(_quiet_sigint_in_task_processes)
