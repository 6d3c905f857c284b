"""The private interfaces of Luigi and torch that the code leans on, each by name: where one
vanishes or changes its shape in a new release, this test says which, before a run does
(pyproject.toml bounds the versions these were checked with).

* ``luigi.interface._run``: wrapped by workflows/ending.py (exit code, report line, Ctrl-C and SIGTERM);
  Luigi offers no hook at the end of a command-line run.
* ``luigi.execution_summary._root_task`` and ``_summary_dict``: read there too, as
  ``luigi.retcodes.run_with_retcodes`` itself reads them.
* ``luigi.worker.Worker._add_task``, its ``_scheduled_tasks`` and ``_scheduler``: wrapped by
  workflows/failover.py (a task that raised is disabled, a lost worker's task is retried).
* ``luigi.Parameter._parser_kwargs``: ``--set`` repeatable (workflows/experiment.py, OverridesParameter).
* ``torch._C._storage_Use_Count`` and ``UntypedStorage._cdata``: whether a batch buffer is still held
  (zgcore/data/boundary_store/memory.py); torch has no public use count of a storage.
"""
import inspect

import luigi
import luigi.execution_summary
import luigi.interface
import luigi.retcodes
import luigi.worker
import torch

import workflows  # noqa: F401 (installs the wrappers, so their originals are checked through them)


def _original(f):
    return getattr(f, "__wrapped__", f)


def test_luigi_interface_run_takes_the_command_line_and_returns_a_result():
    params = list(inspect.signature(_original(luigi.interface._run)).parameters)
    assert params[:1] == ["cmdline_args"], f"luigi.interface._run{params}: workflows/ending.py wraps it"
    assert "luigi.interface._run(" in inspect.getsource(luigi.retcodes.run_with_retcodes), \
        "run_with_retcodes no longer calls luigi.interface._run: workflows/ending.py's wrapper is never reached"


def test_luigi_execution_summary_privates_exist():
    for name in ("_root_task", "_summary_dict"):
        assert callable(getattr(luigi.execution_summary, name, None)), f"luigi.execution_summary.{name} is gone"
    assert {"failed", "scheduling_error"} <= set(luigi.execution_summary._ORDERED_STATUSES)


def test_luigi_worker_add_task_and_its_fields():
    add = _original(luigi.worker.Worker._add_task)
    assert list(inspect.signature(add).parameters)[:1] == ["self"], "luigi.worker.Worker._add_task changed"
    src = inspect.getsource(luigi.worker.Worker.__init__)
    for field in ("self._scheduled_tasks", "self._scheduler"):
        assert field in src, f"luigi.worker.Worker no longer sets {field} (workflows/failover.py reads it)"
    assert "status=" in inspect.getsource(add) or "**kwargs" in inspect.getsource(add)


def test_luigi_parameter_parser_kwargs():
    kw = luigi.Parameter._parser_kwargs("x", "T")
    assert isinstance(kw, dict) and {"action", "dest"} <= set(kw), "luigi.Parameter._parser_kwargs changed (OverridesParameter)"


def test_torch_storage_use_count():
    assert hasattr(torch._C, "_storage_Use_Count"), "torch._C._storage_Use_Count is gone (boundary_store/memory.py)"
    st = torch.zeros(4).untyped_storage()
    assert torch._C._storage_Use_Count(st._cdata) >= 1


PRIVATE = [(luigi.interface, "_run"), (luigi.execution_summary, "_root_task"), (luigi.execution_summary, "_summary_dict"),
           (luigi.worker.Worker, "_add_task"), (luigi.Parameter, "_parser_kwargs"), (torch._C, "_storage_Use_Count")]


def vanished(pairs) -> list[str]:
    """``module.name`` of every ``(owner, name)`` among ``pairs`` that no longer exists."""
    return [f"{getattr(o, '__module__', None) or o.__name__}.{getattr(o, '__qualname__', o.__name__)}.{n}"
            if isinstance(o, type) else f"{o.__name__}.{n}" for o, n in pairs if not hasattr(o, n)]


def test_every_private_interface_exists():
    assert vanished(PRIVATE) == []


def test_a_vanished_interface_is_named():
    assert vanished([(luigi.execution_summary, "_no_such_private")]) == ["luigi.execution_summary._no_such_private"]
