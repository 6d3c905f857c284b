"""The checks every registered workflow meets on its tiny preset (workflows/registry.py), as
functions that return what is wrong, so that a deliberately broken workflow can be shown to fail
them by name (tests/test_workflow_contract.py). Follows scikit-learn's ``check_estimator``.

* it runs (``luigi.build`` of the workflow task, local scheduler);
* ``zerograph status --preset <tiny>`` lists exactly the tasks of that workflow's graph, each ``done``;
* ``zerograph report --preset <tiny>`` prints the report file of its root task;
* ``zerograph verify --preset <tiny>`` checks every output folder of its graph exactly once, and
  says so in its count.
"""
from __future__ import annotations

import re
from pathlib import Path

import luigi
from typer.testing import CliRunner

import workflows
from workflows import registry
from workflows.cli import all_tasks, app, report_path, root_tasks


def _cli(*args: str):
    return CliRunner().invoke(app, list(args), terminal_width=400)


def smoke_presets() -> list[str]:
    """Every smoke preset file: ``tiny`` and ``*_tiny`` (workflows/presets)."""
    return sorted(p for p in registry.preset_files() if p == "tiny" or p.endswith("_tiny"))


def run_tiny(wf: registry.Workflow, outputs: Path, preset: str | None = None) -> list[str]:
    """Build ``wf`` on ``preset`` (default: its tiny preset) under ``outputs``; returns the problems
    (``[]``: it ran)."""
    task = getattr(workflows, wf.name)(preset=preset or wf.tiny, outputs=str(outputs))
    res = luigi.build([task], local_scheduler=True, log_level="WARNING", detailed_summary=True)
    return [] if res.scheduling_succeeded and task.complete() else [f"{wf.name}: runs: {res.summary_text}"]


def check_workflow(wf: registry.Workflow, outputs: Path) -> list[str]:
    """Every problem of the contract for ``wf``, whose tiny preset was built under ``outputs``; each
    message starts with ``<workflow>: <check>:``."""
    out, problems = str(outputs), []
    opts = ["--preset", wf.tiny, "--outputs", out, "--workflow", wf.name]
    owner = registry.owner(wf.tiny)
    if owner is None or owner.name != wf.name:
        problems.append(f"{wf.name}: tiny preset: {wf.tiny!r} is owned by {owner.name if owner else 'no workflow'}")
    graph = all_tasks(root_tasks("", [], wf.tiny, out, wf.name))

    r = _cli("status", *opts)
    rows = []
    for line in r.stdout.splitlines():
        m = re.match(r"(.+?)\s{2,}(done|missing|partial|damaged|stale)\s+(.+)$", line.strip())
        if m:
            rows.append((m.group(1), m.group(2)))
    titles = sorted(t.title() for t in graph)
    if r.exit_code != 0 or sorted(n for n, _ in rows) != titles or {s for _, s in rows} != {"done"}:
        problems.append(f"{wf.name}: status: exit {r.exit_code}, rows {rows} for the graph's tasks {sorted(titles)}")

    r = _cli("report", *opts)
    path = report_path(root_tasks("", [], wf.tiny, out, wf.name), wf)
    if r.exit_code != 0 or not path.is_file() or r.stdout.strip() != path.read_text().strip() or not r.stdout.strip():
        problems.append(f"{wf.name}: report: exit {r.exit_code}, {path} {'exists' if path.is_file() else 'missing'}; "
                        f"printed {r.stdout[:200]!r}{r.stderr[:200]!r}")

    from workflows.verify import verify

    items, bad = verify(graph, bar=False)
    folders = [Path(i.folder).resolve() for i in items if i.folder is not None]
    outputs_ = {Path(t.out_dir).resolve() for t in graph}
    unchecked = sorted(str(p) for p in outputs_ - set(folders))
    if bad or unchecked or set(folders) != outputs_:
        problems.append(f"{wf.name}: verify: {len(items)} item(s) for {len(outputs_)} output(s); not checked: "
                        f"{unchecked}; damaged: {bad}")
    r = _cli("verify", *opts)
    if r.exit_code != 0 or f"verified {len(items)} item(s) of {len(outputs_)} output(s)" not in r.stdout:
        problems.append(f"{wf.name}: verify: `zerograph verify` exit {r.exit_code}: {r.stdout.strip()[-300:]}")
    return problems
