"""What ``zerograph slurm`` knows of a workflow and of its launches: the workflow task as
``luigi --module workflows <Workflow>`` builds it, its tasks, which are missing, its reports, the
teacher-and-corpus task the launcher builds on the submitting host (:class:`PrepareFor`), and the
launch record kept in ``<outputs>/slurm/<experiment id>/launch.json`` for ``status`` and ``cancel``.
The commands themselves are :mod:`workflows.slurm`'s; the cluster's side is :mod:`workflows.slurm_cluster`'s.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import luigi
import typer
from luigi.task import flatten

from . import RETCODES
from .experiment import CONFIG_ERROR_EXIT, or_exit, walk
from .slurm_cluster import ACTIVE, job_states, stop_luigid

# A worker's exit code, named (luigi.cfg [retcode]); 2 is the job script's own "outputs not shared".
LUIGI_CODES = {code: name for name, code in RETCODES.items()} | {2: "configuration error or outputs not shared"}


def fail(msg: str) -> None:
    """Print ``error: msg`` on stderr and exit :data:`CONFIG_ERROR_EXIT` (2)."""
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(CONFIG_ERROR_EXIT)


# --- the workflow ------------------------------------------------------------------------------

def workflow_classes() -> dict[str, type]:
    """The top-level workflows a launch can run, by name: those of :mod:`workflows.registry`."""
    import workflows

    from . import registry

    return {name: getattr(workflows, name) for name in registry.names()}


def experiment_options(config: str, set_: str, preset: str | None, outputs: str) -> list[str]:
    """The workflow's command-line options as given (``--preset`` only when given, so each workflow
    keeps its own default)."""
    args = ["--outputs", outputs]
    for flag, value in (("--preset", preset), ("--config", config), ("--set", set_)):
        if value is not None and (value != "" or flag == "--preset"):
            args += [flag, value]
    return args


def make_workflow(name: str, config: str, set_: str, preset: str | None, outputs: str):
    """The workflow task as ``luigi --module workflows <name>`` builds it; a configuration error
    prints one line and exits 2."""
    classes = workflow_classes()
    if name not in classes:
        fail(f"unknown workflow {name!r}; known: {', '.join(sorted(classes))}")
    kwargs = dict(config=config, set=set_, outputs=outputs)
    if preset is not None:
        kwargs["preset"] = preset
    return or_exit(lambda: classes[name](**kwargs))


def experiment_id(name: str, wf) -> str:
    """``<Workflow>-<name>-<12 hex>``: the digest covers the output folders of the workflow's root
    tasks, so the same experiment spelled with other options (a file or ``--set``) has the same id."""
    roots = sorted(str(Path(t.out_dir).relative_to(Path(t.outputs))) if hasattr(t, "out_dir") else t.task_id
                   for t in flatten(wf.requires()))
    digest = hashlib.sha256("\n".join(roots).encode()).hexdigest()[:12]
    return f"{name}-{wf.cfg.get('name', 'experiment')}-{digest}"


def prepare_tasks(wf) -> list:
    """The workflow's ``PrepareTeacher`` and ``PrepareCorpus`` tasks (built before the workers start)."""
    from tasks import PrepareCorpus, PrepareTeacher

    return [t for t in walk_all(wf) if isinstance(t, (PrepareTeacher, PrepareCorpus))]


def walk_all(wf) -> list:
    """Every task under the workflow's roots, each once."""
    seen: dict[str, Any] = {}
    for root in flatten(wf.requires()):
        for t in walk(root):
            seen.setdefault(t.task_id, t)
    return list(seen.values())


def missing_tasks(wf) -> list:
    """The workflow's tasks whose outputs are not complete (``[]``: the workflow is done)."""
    from tasks.base import completion_pass

    with completion_pass():
        return [t for t in walk_all(wf) if not t.complete()]


def reports(wf) -> list[Path]:
    """The report of each root task (its :mod:`workflows.registry` entry's ``report`` in its folder,
    else the folder)."""
    from . import registry

    name = registry.get(wf.get_task_family()).report if wf.get_task_family() in registry.names() else "report.md"
    out = []
    for t in flatten(wf.requires()):
        d = Path(t.out_dir)
        out.append(d / name if (d / name).is_file() else d)
    return out


class PrepareFor(luigi.WrapperTask):
    """The teacher and corpus tasks of one workflow (:func:`prepare_tasks`): what the launcher runs
    on the submitting host with ``luigi --module workflows.slurm_graph PrepareFor --local-scheduler``."""

    workflow = luigi.Parameter()
    config = luigi.Parameter(default="")
    set = luigi.Parameter(default="")
    preset = luigi.OptionalParameter(default=None)
    outputs = luigi.Parameter()

    def requires(self):
        return prepare_tasks(make_workflow(self.workflow, self.config, self.set, self.preset, self.outputs))


# --- records -----------------------------------------------------------------------------------

def record_path(outputs: str, exp: str) -> Path:
    """``<outputs>/slurm/<experiment id>/launch.json``: what a launch keeps for status and cancel."""
    return Path(outputs) / "slurm" / exp / "launch.json"


def load_record(path: Path) -> dict[str, Any]:
    """The launch record at ``path`` (``{"launches": []}`` when there is none yet)."""
    return json.loads(path.read_text()) if path.is_file() else {"launches": []}


def save_record(path: Path, rec: dict[str, Any]) -> None:
    """Write the experiment's launch record atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(rec, indent=2) + "\n")
    os.replace(tmp, path)


def active_jobs(rec: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The recorded jobs Slurm still has pending or running."""
    ids = [launch["array_job"] for launch in rec.get("launches", []) if launch.get("array_job")]
    return {k: v for k, v in job_states(ids).items() if v["state"] in ACTIVE} if ids else {}


def print_jobs(states: dict[str, dict[str, str]], folder: Path) -> None:
    """One line per job: state, exit code (named when it is one of Luigi's), node, log file."""
    for jid, s in states.items():
        where = f" on {s['node']}" if s["node"] else ""
        extra = ""
        if s["exit"] and s["state"] not in ACTIVE:
            code = int(s["exit"].split(":")[0]) if s["exit"].split(":")[0].isdigit() else -1
            extra = f" exit {code}" + (f" (luigi: {LUIGI_CODES[code]})" if code in LUIGI_CODES else "")
        why = f" ({s['reason']})" if s["reason"] and s["state"] != "RUNNING" and s["reason"] != "NonZeroExitCode" else ""
        log = folder / "logs" / f"worker-{jid}.log"
        typer.echo(f"job {jid}: {s['state']}{extra}{where}{why}  log: {log}")


def stop_idle_luigids(rec: dict[str, Any]) -> None:
    """Stop the luigids of launches with no job left pending or running."""
    for launch in rec.get("launches", []):
        info = launch.get("luigid") or {}
        if info.get("pid") and not active_jobs({"launches": [launch]}):
            stop_luigid(info)
