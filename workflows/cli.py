"""``zerograph``: what Luigi's own CLI does not give — each task's state, and an experiment's report."""
from __future__ import annotations

import shlex

import typer

from tasks import ZGTask

from .experiment import build_experiment, load_config, or_exit, walk  # noqa: F401 (walk: zerograph's and the tests')

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


def workflow_of(preset: str) -> str:
    """The workflow a preset is run with: ``LocalLearningStudy`` for ``local_*``, ``DistillStudy``
    for ``distill*``, ``ObjectiveStudy`` for ``study``, else ``RunExperiment``."""
    from .experiment import preset_owner

    if preset and preset_owner(preset) == "LocalLearningStudy":
        return "LocalLearningStudy"
    if preset.startswith("distill"):
        return "DistillStudy"
    return "ObjectiveStudy" if preset == "study" else "RunExperiment"


def _graph(config, set_, preset, outputs):
    """The root task of the preset's workflow (:func:`workflow_of`: a study's report task, or an
    experiment's); a configuration error prints one line and exits ``CONFIG_ERROR_EXIT`` (2)."""
    over, kind = "\n".join(set_), workflow_of(preset)

    def build():
        if kind == "LocalLearningStudy":
            from .local import build_local_study, load_local_config

            return build_local_study(load_local_config(config, over, preset), outputs)
        if kind == "DistillStudy":
            from . import DistillStudy

            return DistillStudy(config=config, set=over, preset=preset, outputs=outputs).requires()
        if kind == "ObjectiveStudy":
            from .experiment import build_study

            return build_study(load_config(config, over, preset), outputs)
        return build_experiment(load_config(config, over, preset), outputs)
    return or_exit(build)


def run_command(config: str, set_: list[str] | str, preset: str, outputs: str) -> str:
    """The `luigi` command that builds this experiment or study, with the options the user gave
    (each ``--set`` as given, in order)."""
    args = [".venv/bin/luigi", "--module", "workflows", workflow_of(preset), "--local-scheduler"]
    sets = [set_] if isinstance(set_, str) else list(set_)
    for flag, value, default in (("--preset", preset, "default"), ("--config", config, ""),
                                 *(("--set", v, "") for v in sets), ("--outputs", outputs, "outputs")):
        if value != default:
            args += [flag, value]
    return shlex.join(args)


@app.command(epilog="\n\n".join(f"{word}: {meaning}" for word, meaning in STATES.items()))
def status(config: str = ConfigOpt, set: list[str] = SetOpt, preset: str = PresetOpt, outputs: str = OutputsOpt):
    """Each task of an experiment or study (``--preset local_tiny``, ``distill_tiny``, ``study``: that
    study's tasks), its state and its folder. Exits 0 when every task is done, else 1
    (so a script can check a run that several workers shared); 2 on a configuration error. The
    states are listed below."""
    tasks = walk(_graph(config, set, preset, outputs))
    width = max(len(t.title()) for t in tasks)
    states = [task_state(t) for t in tasks]
    for t, state in zip(tasks, states):
        name = t.title()
        typer.echo(f"{name:<{width}}  {state:<8} {t.out_dir}")
    if any(s != "done" for s in states):
        typer.echo(f"not all done; run: {run_command(config, set, preset, outputs)}", err=True)
        raise typer.Exit(1)


@app.command()
def report(config: str = ConfigOpt, set: list[str] = SetOpt, preset: str = PresetOpt, outputs: str = OutputsOpt,
           as_json: bool = typer.Option(False, "--json", help="print report.json instead of report.md")):
    """Print an experiment's report, or a study's (``--preset local_tiny``, ``distill_tiny``,
    ``study``: the study's own report); exit 1 if it has not been built, with the command that builds
    it; 2 on a configuration error."""
    ev = _graph(config, set, preset, outputs)
    path = ev.out_dir / ("report.json" if as_json else "report.md")
    if not path.is_file():
        typer.echo(f"no report yet at {path}; run: {run_command(config, set, preset, outputs)}", err=True)
        raise typer.Exit(1)
    typer.echo(path.read_text())


@app.command()
def verify(config: str = ConfigOpt, set: list[str] = SetOpt, preset: str = PresetOpt, outputs: str = OutputsOpt,
           clean: bool = typer.Option(False, "--clean", help="first remove every temporary file or folder under "
                                      "--outputs whose writer is gone (killed, node lost)"),
           stale_hours: float = typer.Option(24.0, "--stale-hours", help="with --clean: a temporary name written on "
                                             "another host is a dead writer's once unchanged this long")):
    """Check every byte of an experiment's stored artefacts that a run checks only in part when it
    reads them (every shard of the boundary store, against the SHA-256 recorded when it was
    written; the statistics files; every file of every finished task output, against the SHA-256
    in its task.json), with a progress bar. Each damaged shard, file or output is named and
    moved aside (<folder>.damaged-<time>) so that the next run rebuilds it; exits 1 if any was
    damaged, 0 when all are whole, 2 on a configuration error."""
    from .verify import verify as run_checks
    from .verify_outputs import clean_leftovers

    if clean:
        for p in clean_leftovers(outputs, stale_hours * 3600):
            typer.echo(f"removed {p}, left by a writer that no longer runs")
    items, problems = run_checks(walk(_graph(config, set, preset, outputs)))
    for path, why in problems:
        typer.echo(f"damaged: {path}: {why}", err=True)
    if problems:
        typer.echo(f"{len(problems)} damaged of {len(items)} checked; rebuild with: {run_command(config, set, preset, outputs)}",
                   err=True)
        raise typer.Exit(1)
    typer.echo(f"verified {len(items)} item(s), {sum(i.nbytes for i in items) / 1e9:.3f} GB: all whole")


from .slurm import app as slurm_app  # noqa: E402

app.add_typer(slurm_app, name="slurm")


def main() -> None:
    """Entry point of the ``zerograph`` command."""
    app()
