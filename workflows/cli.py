"""``zerograph``: what Luigi's own CLI does not give — each task's state, and an experiment's report.

Which workflow a preset belongs to, its root task and its report come from :mod:`workflows.registry`.
Start-up stays light: this module imports neither torch nor transformers; a command that builds a
graph imports the tasks when it builds it.
"""
from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

import typer

from . import registry
from .experiment import build_experiment, load_config, or_exit, walk  # noqa: F401 (walk: zerograph's and the tests')

if TYPE_CHECKING:
    from tasks import ZGTask

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="ZeroGraph: inspect experiments built with `luigi --module workflows RunExperiment`.")

ConfigOpt = typer.Option("", "--config", "-c", help="experiment file (.toml/.yaml)")
SetOpt = typer.Option([], "--set", "-s", help='overrides, e.g. "train.lr=1e-4 blocks.1.lr=5e-5"; repeatable '
                                             '(applied in order: a later key wins)')
PresetOpt = typer.Option("default", "--preset", "-p", help="preset in workflows/presets")
OutputsOpt = typer.Option("outputs", "--outputs", "-o", help="root folder of run artifacts")


STATES = {  # the words `zerograph status` prints, and what each means (also in its --help and README)
    "done": "built for this configuration, and whole",
    "missing": "never built for this configuration (no folder under its hash; folders of the same step "
               "built for other configurations do not count)",
    "partial": "not built yet, but an interrupted run left checkpoints in <folder>.partial: the next run resumes",
    "damaged": "its folder exists but a file is missing, cut short or fails its check: the next run moves it "
               "aside (<folder>.damaged-<time>-<id>) and rebuilds it",
    "stale": "its folder exists and is whole, but an input it read was rebuilt after it or is not complete: "
             "the next run moves it aside (<folder>.stale-<time>-<id>) and rebuilds it",
}


def task_state(t: ZGTask) -> str:
    """One of :data:`STATES` for ``t``, judged only from its own folder under its current hash
    (``<folder>``, ``<folder>.partial``); reads files, runs nothing, moves nothing."""
    if t.out_dir.is_dir():
        problem = t.check_output()
        return "done" if problem is None else problem[0]
    return "partial" if t.out_dir.with_name(t.out_dir.name + ".partial").is_dir() else "missing"


def graph_states(tasks: list) -> list[str]:
    """:func:`task_state` of each of ``tasks`` in one look at the graph (each task checked once)."""
    from tasks.base import completion_pass

    with completion_pass():
        return [task_state(t) for t in tasks]


def pick(preset: str, workflow: str | None = None) -> registry.Workflow:
    """The registered workflow to inspect: ``workflow`` when given, else the owner of ``preset``
    (:mod:`workflows.registry`; ``RunExperiment`` for an empty preset). An unknown workflow or preset
    prints one line and exits ``CONFIG_ERROR_EXIT`` (2)."""
    from zgcore.config.experiment import ConfigError

    def find():
        if workflow:
            try:
                return registry.get(workflow)
            except KeyError as e:
                raise ConfigError(e.args[0]) from None
        found = registry.owner(preset) if preset else registry.get("RunExperiment")
        if found is None:
            raise ConfigError(f"unknown preset {preset!r}; known: {', '.join(registry.preset_files())}")
        return found
    return or_exit(find)


def root_tasks(config: str, set_: list[str] | str, preset: str, outputs: str, workflow: str | None = None) -> list:
    """The root tasks of the workflow (:func:`pick`) as ``luigi --module workflows <Workflow>`` builds
    them from the same options; a configuration error prints one line and exits ``CONFIG_ERROR_EXIT`` (2)."""
    import luigi.task

    import workflows

    wf = pick(preset, workflow)
    over = set_ if isinstance(set_, str) else "\n".join(set_)
    cls = getattr(workflows, wf.name)
    return luigi.task.flatten(or_exit(lambda: cls(config=config, set=over, preset=preset, outputs=outputs).requires()))


def all_tasks(roots: list) -> list:
    """Every task under ``roots``, dependencies first, each once."""
    seen: dict[str, object] = {}
    for r in roots:
        for t in walk(r):
            seen.setdefault(t.task_id, t)
    return list(seen.values())


def run_command(config: str, set_: list[str] | str, preset: str, outputs: str, workflow: str | None = None) -> str:
    """The `luigi` command that builds this experiment or study, with the options the user gave
    (each ``--set`` as given, in order)."""
    wf = pick(preset, workflow)
    args = [".venv/bin/luigi", "--module", "workflows", wf.name, "--local-scheduler"]
    sets = [set_] if isinstance(set_, str) else list(set_)
    for flag, value, default in (("--preset", preset, wf.default_preset), ("--config", config, ""),
                                 *(("--set", v, "") for v in sets), ("--outputs", outputs, "outputs")):
        if value != default:
            args += [flag, value]
    return shlex.join(args)


WorkflowOpt = typer.Option(None, "--workflow", "-w", help="the workflow that ran, when not the preset's own: "
                          + ", ".join(registry.names()) + " (workflows/registry.py)")


@app.command(epilog="\n\n".join(f"{word}: {meaning}" for word, meaning in STATES.items()))
def status(config: str = ConfigOpt, set: list[str] = SetOpt, preset: str = PresetOpt, outputs: str = OutputsOpt,
           workflow: str | None = WorkflowOpt):
    """Each task of the preset's workflow (``--preset library_tiny``: SelectStudent's tasks;
    ``local_tiny``: the local learning study's), its state and its folder. Exits 0 when every task
    is done, else 1 (so a script can check a run that several workers shared); 2 on a configuration
    error. The states are listed below."""
    tasks = all_tasks(root_tasks(config, set, preset, outputs, workflow))
    width = max(len(t.title()) for t in tasks)
    states = graph_states(tasks)
    for t, state in zip(tasks, states):
        name = t.title()
        typer.echo(f"{name:<{width}}  {state:<8} {t.out_dir}")
    if any(s != "done" for s in states):
        typer.echo(f"not all done; run: {run_command(config, set, preset, outputs, workflow)}", err=True)
        raise typer.Exit(1)


def report_path(roots: list, wf: registry.Workflow, as_json: bool = False):
    """The report file of a workflow's root task (:attr:`workflows.registry.Workflow.report`, or the
    ``.json`` beside it)."""
    from pathlib import Path

    name = Path(wf.report).with_suffix(".json").name if as_json else wf.report
    return roots[0].out_dir / name


@app.command()
def report(config: str = ConfigOpt, set: list[str] = SetOpt, preset: str = PresetOpt, outputs: str = OutputsOpt,
           workflow: str | None = WorkflowOpt,
           as_json: bool = typer.Option(False, "--json", help="print report.json instead of report.md")):
    """Print the report of the preset's workflow (``--preset library_tiny``: the library's;
    ``distill_tiny``: the distillation study's); exit 1 if it has not been built, or if it or a task
    it rests on is not done (as `zerograph status` judges: stale, damaged, ...; the report is printed,
    then what is not done), with the command that builds it; 2 on a configuration error."""
    roots = root_tasks(config, set, preset, outputs, workflow)
    path = report_path(roots, pick(preset, workflow), as_json)
    if not path.is_file():
        typer.echo(f"no report yet at {path}; run: {run_command(config, set, preset, outputs, workflow)}", err=True)
        raise typer.Exit(1)
    typer.echo(path.read_text())
    tasks = all_tasks(roots)
    behind = [f"{t.title()} is {s}" for t, s in zip(tasks, graph_states(tasks)) if s != "done"]
    if behind:
        typer.echo(f"this report is out of date ({'; '.join(behind)}); rebuild with: "
                   f"{run_command(config, set, preset, outputs, workflow)}", err=True)
        raise typer.Exit(1)


@app.command()
def verify(config: str = ConfigOpt, set: list[str] = SetOpt, preset: str = PresetOpt, outputs: str = OutputsOpt,
           workflow: str | None = WorkflowOpt,
           clean: bool = typer.Option(False, "--clean", help="first remove every temporary file or folder under "
                                      "--outputs whose writer is gone (killed, node lost)"),
           stale_hours: float = typer.Option(24.0, "--stale-hours", help="with --clean: a temporary name written on "
                                             "another host is a dead writer's once unchanged this long")):
    """Check every byte of the stored artefacts of the preset's workflow that a run checks only in
    part when it reads them (every shard of the boundary store, against the SHA-256 recorded when it
    was written; the statistics files; every file of every finished task output, against the SHA-256
    in its task.json), with a progress bar. Each damaged shard, file or output is named and
    moved aside (<folder>.damaged-<time>) so that the next run rebuilds it; exits 1 if any was
    damaged, 0 when all are whole, 2 on a configuration error."""
    from .verify import verify as run_checks
    from .verify_outputs import clean_leftovers

    if clean:
        for p in clean_leftovers(outputs, stale_hours * 3600):
            typer.echo(f"removed {p}, left by a writer that no longer runs")
    items, problems = run_checks(all_tasks(root_tasks(config, set, preset, outputs, workflow)))
    for path, why in problems:
        typer.echo(f"damaged: {path}: {why}", err=True)
    if problems:
        typer.echo(f"{len(problems)} damaged of {len(items)} checked; rebuild with: "
                   f"{run_command(config, set, preset, outputs, workflow)}", err=True)
        raise typer.Exit(1)
    folders = {i.folder.resolve() for i in items if i.folder is not None}
    typer.echo(f"verified {len(items)} item(s) of {len(folders)} output(s), {sum(i.nbytes for i in items) / 1e9:.3f} GB: "
               "all whole")


@app.command()
def clean(config: str = ConfigOpt, set: list[str] = SetOpt, preset: str = PresetOpt, outputs: str = OutputsOpt,
          workflow: str | None = WorkflowOpt,
          yes: bool = typer.Option(False, "--yes", "-y", help="remove them (without it: only list them)"),
          stale_hours: float = typer.Option(24.0, "--stale-hours", help="a temporary name written on another host "
                                            "is a dead writer's once unchanged this long")):
    """List the folders and files set aside under --outputs, with their sizes: outputs moved aside
    as stale or damaged (``<folder>.stale-*``, ``<folder>.damaged-*``, kept for inspection) and
    temporary names whose writer is gone; with ``--yes``, remove them. Never touches a finished
    output, a ``.partial`` work folder (a resumable checkpoint) or a live writer's temporary name.
    It takes the workflows' options as every command does and checks them (a configuration error
    exits 2), but what it lists is everything set aside under --outputs, whichever run left it.
    Exits 0."""
    from .verify_outputs import remove_set_aside, set_aside

    root_tasks(config, set, preset, outputs, workflow)  # the options are checked as the other commands check them

    found = set_aside(outputs, stale_hours * 3600)
    for path, kind, size in found:
        typer.echo(f"{size / 1e6:10.1f} MB  {kind:<9} {path}")
    total = sum(size for _, _, size in found) / 1e6
    if not found:
        typer.echo(f"nothing set aside under {outputs}")
    elif yes:
        remove_set_aside([p for p, _, _ in found])
        typer.echo(f"removed {len(found)} set-aside item(s), {total:.1f} MB")
    else:
        typer.echo(f"{len(found)} set-aside item(s), {total:.1f} MB; remove them with: zerograph clean --outputs "
                   f"{shlex.quote(outputs)} --yes")


@app.command()
def plan(config: str = ConfigOpt, set: list[str] = SetOpt, preset: str = PresetOpt, outputs: str = OutputsOpt,
         workflow: str | None = WorkflowOpt,
         tokens: int | None = typer.Option(None, "--tokens", help="corpus tokens to plan for (default: the corpus's own)"),
         device: str = typer.Option("cpu", "--device", help="h100 | h200 | a100 (datasheet peaks) | cpu | cuda (this "
                                    "machine, probed now)"),
         devices: int = typer.Option(1, "--devices", help="devices the graph's tasks share (shards and blocks in parallel)"),
         mfu: float | None = typer.Option(None, "--mfu", help="the share of the peak every phase runs at (default: "
                                             "zgcore/evaluation/accelerators.py)"),
         as_json: bool = typer.Option(False, "--json", help="print the plan as JSON (tasks, totals)")):
    """Predict each task of the preset's workflow before it runs: peak host and device memory
    (weights, optimizer state, activations, buffers), bytes written, FLOPs and seconds on --device
    at a stated MFU; and the totals (store size, the peak of any task, device-hours, wall time on
    --devices). Reads the teacher's config.json only: no weight file is opened. Exits 0; 2 on a
    configuration error."""
    import json

    from zgcore.config.experiment import ConfigError
    from zgcore.models.teacher import config_only

    from .plan import make_plan, plan_record

    with config_only():
        roots = root_tasks(config, set, preset, outputs, workflow)

    def build():
        if devices < 1 or tokens is not None and tokens < 1:
            raise ConfigError("--devices and --tokens must be at least 1")
        from zgcore.evaluation.accelerators import device as named

        try:
            dev = named(device, mfu)
        except KeyError as e:
            raise ConfigError(f"--device: {e.args[0]}") from None
        try:
            return make_plan(roots, tokens, dev, devices)
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None

    p = or_exit(build)
    if as_json:
        typer.echo(json.dumps(plan_record(p), indent=1))
        return
    from zgcore.evaluation.plan import table

    typer.echo(table(p["tasks"], p["totals"], p["device"], p["accelerator"]))


@app.command()
def export(config: str = ConfigOpt, set: list[str] = SetOpt, preset: str = PresetOpt, outputs: str = OutputsOpt,
           gguf: bool = typer.Option(False, "--gguf", help="write the student as a GGUF file for llama.cpp, Ollama, "
                                     "LM Studio (the one format so far)"),
           quant: str = typer.Option("f32", "--quant", "-q", help="f32 | f16 | q8_0 | q4_k_m (the last two by "
                                     "llama.cpp's quantizer: needs llama-cpp-python)"),
           budget: int = typer.Option(0, "--budget", help="with a SelectStudent preset: export the pick for "
                                      "library.budgets[BUDGET] (SelectStudent must have chosen it)")):
    """Build the experiment's student (what ``luigi --module workflows RunExperiment`` builds with the same
    options, healed when heal.steps > 0; with a SelectStudent preset the library's pick for one budget) and
    write it as ``model.gguf`` (task ``ExportGGUF``, docs/export.md);
    print its path. Exits 0 when written, 1 when a task failed, 2 on a configuration error (a student
    llama.cpp cannot run included: one line naming the kinds that export)."""
    if not gguf:
        typer.echo("error: give --gguf (GGUF for llama.cpp is the one export format)", err=True)
        raise typer.Exit(2)
    import luigi

    from .export import ExportStudent

    root = or_exit(lambda: ExportStudent(config=config, set="\n".join(set), preset=preset, outputs=outputs, quant=quant,
                                              budget=budget))
    if not luigi.build([root], local_scheduler=True, log_level="WARNING"):
        typer.echo(f"export failed; rerun: zerograph export --gguf --quant {quant} (it resumes)", err=True)
        raise typer.Exit(1)
    typer.echo(str(root.export.out_dir / "model.gguf"))


from .slurm import app as slurm_app  # noqa: E402

app.add_typer(slurm_app, name="slurm")


def main() -> None:
    """Entry point of the ``zerograph`` command."""
    app()
