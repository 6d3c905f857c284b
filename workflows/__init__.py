"""Top-level Luigi wrapper tasks: ``luigi --module workflows RunExperiment --local-scheduler``.

The workflows, their presets and reports are listed once, in :mod:`workflows.registry`
(:func:`all_workflows`). Importing this package loads neither torch nor transformers: the tasks and
the library are imported when a workflow resolves its configuration or builds its graph, so
``zerograph --help`` starts at once.

Importing this package (which ``luigi --module workflows`` does before it reads its exit codes)
sets Luigi's ``[retcode]`` values that the user's Luigi config leaves unset, so a failed run exits
non-zero from whatever folder it is started in, not only where the repository's ``luigi.cfg`` is read.
"""
from __future__ import annotations

import sys

import luigi
import luigi.configuration

from . import ending, failover
from .distill import DistillStudy
from .errors import install as install_error_filter
from .experiment import (CONFIG_ERROR_EXIT, ConvertStudy, ObjectiveStudy, PrepareInputs, RunExperiment, build_experiment, build_study,
                         load_config)
from .export import ExportStudent
from .library import SelectStudent
from .local import LocalLearningStudy
from .registry import all_workflows

# Luigi's own default for every one of these is 0 ("a failed task exits 0"). Same values as luigi.cfg.
RETCODES = {"already_running": 10, "missing_data": 20, "not_run": 25, "task_failed": 30, "scheduling_error": 35,
            "unhandled_exception": 40}


def set_default_retcodes(config=None) -> None:
    """Write :data:`RETCODES` into Luigi's configuration where it has no value of its own, Luigi's
    process lock off (``[core] no_lock``: a second identical command runs too, and waits for each task
    the first is building, :mod:`tasks.exclusive`) and Luigi's log level WARNING where none is set (each task prints its own lines; ``--log-level INFO`` on the
    command line gives Luigi's back)."""
    config = config if config is not None else luigi.configuration.get_config()
    if not config.has_section("retcode"):
        config.add_section("retcode")
    for key, code in RETCODES.items():
        if not config.has_option("retcode", key):
            config.set("retcode", key, str(code))
    if not config.has_section("core"):
        config.add_section("core")
    if not config.has_option("core", "no_lock"):  # identical commands may run together: tasks/exclusive.py
        config.set("core", "no_lock", "true")
    if not config.has_option("core", "log_level"):  # Luigi's INFO chatter off (`--log-level INFO` gives it back)
        if not config.has_section("core"):
            config.add_section("core")
        config.set("core", "log_level", "WARNING")


set_default_retcodes()
if any(a == "--module" or a.startswith("--module=") for a in sys.argv[1:]):
    # `luigi --module workflows ...`: Luigi's parser reads every registered task's and config's flags
    # (`--zerograph-threads`, `--TrainBlock-...`) right after importing this package
    import tasks  # noqa: F401
install_error_filter()  # user errors raised inside a task: one `error:` line, no traceback (workflows/errors.py)
ending.install()  # the `luigi` command's exit code, last line and Ctrl-C (workflows/ending.py)
failover.install()  # a task that raised is disabled at once; a lost worker's task is retried (workflows/failover.py)


__all__ = ["RunExperiment", "PrepareInputs", "ObjectiveStudy", "LocalLearningStudy", "DistillStudy", "SelectStudent", "ConvertStudy", "ExportStudent",
           "build_experiment",
           "build_study", "load_config", "all_workflows", "CONFIG_ERROR_EXIT", "RETCODES"]
