"""``zerograph slurm``: run a workflow on a Slurm cluster.

Luigi stays the engine for the graph and Slurm the engine for the machines; this module only
bridges them (docs/slurm.md):

1. the experiment's teacher and tokenised corpus (``PrepareTeacher``, ``PrepareCorpus``) are built
   on the submitting host, so every worker schedules every teacher-cache shard;
2. a ``luigid`` is started on the submitting host (detached, on a free port), reading this
   repository's ``luigi.cfg`` (or ``$LUIGI_CONFIG_PATH``), with ``[resources] gpu`` set to the GPUs
   asked for when that file sets none;
3. N worker jobs are submitted as one job array (``sbatch --parsable``) from a generated script:
   each runs ``luigi --module workflows <Workflow> --scheduler-host H --scheduler-port P --no-lock
   --workers 1`` with the experiment's options, ``OMP_NUM_THREADS`` from the job's CPUs, and on GPUs
   ``device=cuda`` with one such worker per GPU Slurm gave the job (``CUDA_VISIBLE_DEVICES``);
4. the launcher waits for the jobs (or returns at once with ``--detach``), prints each job's state
   and the report's path, and exits 0 only when every task of the workflow is complete, judged
   from the outputs folder as ``zerograph status`` does (never from the workers' exit codes).

Job ids, the luigid's address, the generated script and the logs are kept in
``<outputs>/slurm/<experiment id>/``, for ``zerograph slurm status`` and ``cancel``; rerunning the
launcher on a partly done experiment starts a fresh luigid and workers that run only what is missing.
Submitit is not used: the jobs are shell commands, so a plain sbatch script says everything.
"""
from __future__ import annotations

import datetime as _dt
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import typer
import typer.core

from . import plan, registry
from .slurm_cluster import (ACTIVE, ROOT, SLURM_TOOLS, UsageError, job_states, local_folder_reason, luigi_cfg_path,
                            partition_nodes, scheduler_address, short_host, start_luigid, stop_luigid, free_port,
                            worker_script, write_luigid_cfg, slurm)
from .slurm_probe import preflight
from .slurm_graph import (active_jobs, experiment_id, experiment_options, fail, load_record, make_workflow,
                          missing_tasks, print_jobs, record_path, reports, save_record, stop_idle_luigids)


# --- the commands ------------------------------------------------------------------------------

class WorkflowFirst(typer.core.TyperGroup):
    """``zerograph slurm RunExperiment ...`` means ``zerograph slurm launch RunExperiment ...``."""

    def resolve_command(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["launch", *args]
        return super().resolve_command(ctx, args)


app = typer.Typer(cls=WorkflowFirst, add_completion=False, no_args_is_help=True,
                  help="Run a workflow on a Slurm cluster: luigid here, N worker jobs (docs/slurm.md). "
                       "Workflows: " + ", ".join(registry.names()) + ".")

ConfigOpt = typer.Option("", "--config", "-c", help="experiment file (.toml/.yaml)")
SetOpt = typer.Option([], "--set", "-s", help='overrides, e.g. "train.lr=1e-4 blocks.1.lr=5e-5"; repeatable '
                                             '(applied in order: a later key wins)')
PresetOpt = typer.Option(None, "--preset", "-p", help="preset in workflows/presets (default: the workflow's)")
OutputsOpt = typer.Option(..., "--outputs", "-o", help="root folder of run artifacts: absolute, shared by every node")
WorkflowArg = typer.Argument("RunExperiment", help=" or ".join(", ".join(registry.names()).rsplit(", ", 1))
                             + " (workflows/registry.py)")


def _check_tools() -> None:
    missing = [t for t in SLURM_TOOLS if not shutil.which(t)]
    if missing:
        fail(f"{', '.join(missing)} not on PATH: run this on a Slurm login node (or start a test cluster: scripts/slurm_local.sh start)")


def _resolve(workflow: str, config: str, set_: str, preset: str | None, outputs: str, gpus: int,
             launching: bool = True):
    """Check the outputs path (and, ``launching``, the device against the GPUs asked for), then
    build the workflow; returns (the ``--set`` string with ``device=cuda`` added for GPUs, the
    workflow task, the experiment id). Exits 2 on bad input."""
    if not isinstance(set_, str):  # repeated --set options: one per line, applied in order (zgcore.config.overrides)
        set_ = "\n".join(set_)
    if not os.path.isabs(outputs):
        fail(f"--outputs must be an absolute path on a folder every node mounts at the same place, not {outputs!r}")
    if gpus and not re.search(r"(^|\s)device=", set_):
        set_ = f"{set_} device=cuda".strip()
    wf = make_workflow(workflow, config, set_, preset, outputs)
    device = str(wf.cfg.get("device", "cpu"))
    if launching and gpus and not device.startswith("cuda"):
        fail(f"--gpus-per-worker {gpus} with device={device}: drop device= from the options (the launcher sets device=cuda)")
    if launching and not gpus and device.startswith("cuda"):
        fail(f"device={device} needs --gpus-per-worker 1 (or more)")
    return set_, wf, experiment_id(workflow, wf)


@app.command()
def launch(workflow: str = WorkflowArg,
           workers: int = typer.Option(2, "--workers", "-n", min=1, help="worker jobs (one job array)"),
           gpus_per_worker: int = typer.Option(0, "--gpus-per-worker", "-g", min=0,
                                               help="GPUs per job (--gres=gpu:G, one luigi worker per GPU)"),
           cpus_per_worker: int = typer.Option(1, "--cpus-per-worker", min=1, help="CPUs per job (--cpus-per-task)"),
           tasks_per_worker: int = typer.Option(1, "--tasks-per-worker", min=1,
                                                help="Slurm tasks per job (--ntasks): K for a pipelined local-learning "
                                                     "run (train.execution=pipeline), whose K stages run as one srun"),
           mem: str | None = typer.Option(None, "--mem", help="memory per job, e.g. 32G (--mem; default: "
                                                       "the plan's largest task and a quarter more)"),
           partition: str | None = typer.Option(None, "--partition", help="Slurm partition (default: the cluster's)"),
           time_limit: str | None = typer.Option(None, "--time", help="time limit per job, e.g. 04:00:00 "
                                                                    "(default: twice the plan's wall time)"),
           config: str = ConfigOpt, set: list[str] = SetOpt, preset: str | None = PresetOpt, outputs: str = OutputsOpt,
           detach: bool = typer.Option(False, "--detach", help="return once the jobs are submitted"),
           sbatch_args: str = typer.Option("", "--sbatch", help='more sbatch options, e.g. "--account=abc --qos=high"'),
           scheduler_host: str | None = typer.Option(None, "--scheduler-host",
                                                        help="this host's name as the nodes reach it (default: its FQDN)"),
           scheduler_port: int = typer.Option(0, "--scheduler-port", help="luigid's port (default: a free one)"),
           poll: float = typer.Option(5.0, "--poll", help="seconds between job-state checks while waiting"),
           dry_run: bool = typer.Option(False, "--dry-run", help="print the job script; start and submit nothing "
                                                                 "(works without a reachable cluster: placeholders)"),
           preflight_check: bool = typer.Option(True, "--preflight/--no-preflight",
                                                help="run a short probe job on the partition before submitting"),
           probe_timeout: float = typer.Option(600.0, "--probe-timeout", help="seconds to wait for the probe job")):
    """Prepare the inputs here, start luigid here, submit N worker jobs, wait for them.

    Exits 0 when every task of the workflow is complete, 1 when the jobs ended with work left
    (rerun the same command: only what is missing runs), 2 on bad input (nothing submitted)."""
    if dry_run:  # the job script, with placeholders where only a running cluster can answer
        set_, wf, exp = _resolve(workflow, config, set, preset, outputs, gpus_per_worker)
        mem, time_limit = plan.slurm_sizes(wf, workers, mem, time_limit)
        typer.echo(_dry_run(workflow, exp, experiment_options(config, set_, preset, outputs), workers, gpus_per_worker,
                            cpus_per_worker, partition, time_limit, mem, outputs, shlex.split(sbatch_args),
                            scheduler_host, scheduler_port, tasks_per_worker))
        return
    _check_tools()
    set_, wf, exp = _resolve(workflow, config, set, preset, outputs, gpus_per_worker)
    mem, time_limit = plan.slurm_sizes(wf, workers, mem, time_limit)
    sched_host = _scheduler_host(partition, outputs, scheduler_host)
    folder, extra = Path(outputs) / "slurm" / exp, shlex.split(sbatch_args)
    options = experiment_options(config, set_, preset, outputs)
    port = scheduler_port or free_port()
    script = worker_script(folder, workflow, options, workers=workers, gpus=gpus_per_worker, cpus=cpus_per_worker,
                           partition=partition, time_limit=time_limit, mem=mem, sched_host=sched_host,
                           sched_port=port, name=f"zg-{exp}"[:60], extra=extra, tasks=tasks_per_worker)
    test = subprocess.run(["sbatch", "--test-only"], input=script, capture_output=True, text=True, timeout=120)
    if test.returncode != 0:
        fail(f"sbatch refused the job: {(test.stderr.strip().splitlines() or ['?'])[-1]}")
    rec = _idle_record(rec_path := folder / "launch.json", exp)
    if _already_complete(wf, exp):
        return
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    (script_path := folder / "worker.sbatch").write_text(script)
    rec.update(experiment=exp, workflow=workflow, options=options, root=str(ROOT))
    save_record(rec_path, rec)  # the job script and the pre-flight probe check that a node sees this file
    launch_rec = _start_scheduler(folder, workers, gpus_per_worker, sched_host, port, script_path)
    if preflight_check:
        _preflight(folder, sched_host, port, partition, extra, probe_timeout, launch_rec["luigid"], outputs)
    typer.echo(f"{exp}: preparing the teacher and corpus here (log: {folder / 'logs' / 'prepare.log'})")
    _prepare(workflow, config, set_, preset, outputs, folder, on_failure=lambda: stop_luigid(launch_rec["luigid"]))
    _submit(script_path, launch_rec, rec, rec_path)
    typer.echo(f"submitted job array {launch_rec['array_job']} ({workers} worker jobs); "
               f"luigid: http://{sched_host}:{port}  records: {folder}")
    if detach:
        typer.echo(f"follow it with: zerograph slurm status {_cmd_options(workflow, options)}")
        return
    raise typer.Exit(_wait(wf, rec, rec_path, folder, poll, workflow, options))


def _scheduler_host(partition: str | None, outputs: str, scheduler_host: str | None) -> str:
    """The host name the partition's nodes reach luigid at, once ``outputs`` is known to be shared
    by them (else the one-line error, exit 2)."""
    try:
        nodes = partition_nodes(partition)
        reason = local_folder_reason(Path(outputs))
        if reason and {short_host(n) for n in nodes} != {short_host(socket.gethostname())}:
            raise UsageError(f"--outputs {outputs} is not shared by the nodes of the partition: {reason}")
        return scheduler_host or scheduler_address(nodes)
    except UsageError as e:
        fail(str(e))


def _already_complete(wf, exp: str) -> bool:
    """Whether every task of the workflow ``wf`` is complete (then its reports are printed)."""
    if missing_tasks(wf):
        return False
    typer.echo(f"{exp}: already complete, nothing submitted")
    for r in reports(wf):
        typer.echo(f"report: {r}")
    return True


def _submit(script_path: Path, launch_rec: dict, rec: dict, rec_path: Path) -> None:
    """Submit the job array of ``script_path`` and record it (its id in ``launch_rec["array_job"]``);
    on a refusal luigid is stopped and the one-line error exits 2."""
    r = slurm("sbatch", "--parsable", str(script_path), check=False)
    if r.returncode != 0:
        stop_luigid(launch_rec["luigid"])
        fail(f"sbatch failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    launch_rec["array_job"] = r.stdout.strip().split(";")[0]
    rec["launches"].append(launch_rec)
    save_record(rec_path, rec)


def _idle_record(rec_path: Path, exp: str) -> dict:
    """The launch record at ``rec_path``, once no job of it is pending or running (else exit 2) and
    its idle luigids are stopped."""
    rec = load_record(rec_path)
    try:
        running = active_jobs(rec)
    except UsageError as e:
        fail(str(e))
    if running:
        fail(f"jobs {', '.join(running)} of {exp} are still pending or running: wait for them "
             f"(zerograph slurm status) or cancel them (zerograph slurm cancel), then rerun")
    stop_idle_luigids(rec)
    return rec


def _start_scheduler(folder: Path, workers: int, gpus_per_worker: int, sched_host: str, port: int,
                     script_path: Path) -> dict:
    """Start luigid for this launch (its GPU resource limit written beside it); returns the launch's
    record (time, workers, script, luigid's address, pid, state and config)."""
    cfg, gpu_limit = write_luigid_cfg(folder, workers * gpus_per_worker)
    if gpus_per_worker and gpu_limit < workers * gpus_per_worker:
        typer.echo(f"warning: {luigi_cfg_path()} sets [resources] gpu = {gpu_limit}: at most {gpu_limit} GPU tasks "
                   f"run at once of the {workers * gpus_per_worker} GPUs asked for", err=True)
    try:
        pid = start_luigid(folder, port, cfg)
    except UsageError as e:
        fail(str(e))
    return {"time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "workers": workers,
            "script": str(script_path),
            "luigid": {"host": sched_host, "port": port, "pid": pid, "started_on": socket.gethostname(),
                       "state": str(folder / "luigid-state.pickle"), "config": str(cfg)}}


def _preflight(folder: Path, sched_host: str, port: int, partition: str | None, extra: list[str], timeout_s: float,
               luigid: dict, outputs: str) -> None:
    """The pre-flight probe job: a node sees the repository, its Python and ``outputs`` and reaches
    luigid (else luigid is stopped and the one-line error exits 2)."""
    try:
        node = preflight(folder, sched_host, port, partition, extra, timeout_s=timeout_s)
    except UsageError as e:
        stop_luigid(luigid)
        fail(str(e))
    typer.echo(f"pre-flight: {node} sees the repository, its Python and {outputs}, and reaches luigid at "
               f"{sched_host}:{port}")


def _cmd_options(workflow: str, options: list[str]) -> str:
    """The workflow and its options as one shell-quoted string."""
    return shlex.join([workflow, *options])


def _dry_run(workflow: str, exp: str, options: list[str], workers: int, gpus: int, cpus: int, partition, time_limit,
             mem, outputs: str, extra: list[str], scheduler_host, scheduler_port: int, tasks: int = 1) -> str:
    """What ``--dry-run`` prints: the job script as a launch would write it. With Slurm stopped or
    unreachable the partition is not checked and luigid's address is a placeholder (said in a comment)."""
    folder = Path(outputs) / "slurm" / exp
    note = ""
    try:
        sched_host = scheduler_host or scheduler_address(partition_nodes(partition))
        port: int | str = scheduler_port or free_port()
    except (UsageError, OSError, subprocess.SubprocessError) as e:
        sched_host = scheduler_host or "LUIGID_HOST"
        port = scheduler_port or "LUIGID_PORT"
        note = (f"\n# Slurm did not answer ({str(e).splitlines()[0] if str(e) else type(e).__name__}): the partition is not "
                "checked; LUIGID_HOST and LUIGID_PORT stand for what a launch chooses")
    script = worker_script(folder, workflow, options, workers=workers, gpus=gpus, cpus=cpus, partition=partition,
                           time_limit=time_limit, mem=mem, sched_host=sched_host, sched_port=port,
                           name=f"zg-{exp}"[:60], extra=extra, tasks=tasks)
    return (f"# experiment {exp}; would write {folder}/worker.sbatch and run: sbatch --parsable "
            f"{folder}/worker.sbatch{note}\n{script}")


def _prepare(workflow: str, config: str, set_: str, preset: str | None, outputs: str, folder: Path,
             on_failure=lambda: None) -> None:
    """Build the workflow's teacher and corpus here (``PrepareFor`` with Luigi's local scheduler);
    exits 1 with the log's tail when that fails (after ``on_failure()``: the launcher stops luigid)."""
    args = [sys.executable, "-m", "luigi", "--module", "workflows.slurm_graph", "PrepareFor", "--local-scheduler", "--no-lock",
            "--workflow", workflow, "--config", config, "--set", set_, "--outputs", outputs]
    if preset is not None:
        args += ["--preset", preset]
    log = folder / "logs" / "prepare.log"
    with open(log, "a") as f:
        r = subprocess.run(args, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           env={**os.environ, "LUIGI_CONFIG_PATH": str(luigi_cfg_path())})
    if r.returncode != 0:
        on_failure()
        typer.echo(log.read_text()[-3000:], err=True)
        typer.echo(f"error: preparing the teacher and corpus failed (exit {r.returncode}; log: {log}); nothing submitted",
                   err=True)
        raise typer.Exit(1)


def _wait(wf, rec: dict[str, Any], rec_path: Path, folder: Path, poll: float, workflow: str, options: list[str]) -> int:
    """Wait until no job of the latest launch is pending or running, printing state changes; stop
    its luigid; print each job's state and the report; return 0 if the workflow is complete, else 1."""
    launch_rec = rec["launches"][-1]
    seen: dict[str, str] = {}
    try:
        while True:
            states = job_states([launch_rec["array_job"]])
            for jid, s in states.items():
                if seen.get(jid) != s["state"]:
                    seen[jid] = s["state"]
                    typer.echo(f"job {jid}: {s['state']}" + (f" on {s['node']}" if s["node"] else ""))
            if states and not any(s["state"] in ACTIVE for s in states.values()):
                break
            time.sleep(poll)
    except KeyboardInterrupt:
        typer.echo(f"\nstopped waiting; the jobs go on. zerograph slurm status|cancel {_cmd_options(workflow, options)}",
                   err=True)
        return 130
    stop_luigid(launch_rec["luigid"])
    save_record(rec_path, rec)
    return _summary(wf, states, folder)


def _summary(wf, states: dict[str, dict[str, str]], folder: Path) -> int:
    """Print each job and the verdict; 0 when every task of ``wf`` is done, else 1."""
    print_jobs(states, folder)
    missing = missing_tasks(wf)
    if not missing:
        for r in reports(wf):
            typer.echo(f"report: {r}")
        typer.echo("complete: every task is done")
        return 0
    typer.echo(f"not complete: {len(missing)} task(s) missing, e.g. "
               f"{', '.join(t.title() for t in missing[:4])}; see the job logs above, "
               "then rerun the launch command (only what is missing runs)", err=True)
    return 1


def _find(workflow, config, set_, preset, outputs, gpus) -> tuple[Any, Path, dict[str, Any]]:
    set_, wf, exp = _resolve(workflow, config, set_, preset, outputs, gpus, launching=False)
    rec_path = record_path(outputs, exp)
    if not rec_path.is_file():
        launched = sorted(p.parent.name for p in (Path(outputs) / "slurm").glob("*/launch.json"))
        fail(f"{exp} was never launched in {outputs}" + (f"; launched there: {', '.join(launched)}" if launched else ""))
    return wf, rec_path, load_record(rec_path)


GpusOpt = typer.Option(0, "--gpus-per-worker", "-g", min=0, help="as given to launch (it sets device=cuda)")


@app.command()
def status(workflow: str = WorkflowArg, config: str = ConfigOpt, set: list[str] = SetOpt, preset: str | None = PresetOpt,
           outputs: str = OutputsOpt, gpus_per_worker: int = GpusOpt):
    """Each job of a launched experiment, and whether the experiment is complete.

    Exits 0 when every task is done, 1 otherwise; stops the experiment's luigid once none of its
    jobs is pending or running."""
    _check_tools()
    wf, rec_path, rec = _find(workflow, config, set, preset, outputs, gpus_per_worker)
    ids = [la["array_job"] for la in rec["launches"] if la.get("array_job")]
    states = job_states(ids) if ids else {}
    if any(s["state"] in ACTIVE for s in states.values()):
        print_jobs(states, rec_path.parent)
        la = rec["launches"][-1]["luigid"]
        typer.echo(f"running; luigid: http://{la['host']}:{la['port']}")
        n = len(missing_tasks(wf))
        typer.echo(f"{n} task(s) not done yet")
        raise typer.Exit(1)
    stop_idle_luigids(rec)
    save_record(rec_path, rec)
    raise typer.Exit(_summary(wf, states, rec_path.parent))


@app.command()
def cancel(workflow: str = WorkflowArg, config: str = ConfigOpt, set: list[str] = SetOpt, preset: str | None = PresetOpt,
           outputs: str = OutputsOpt, gpus_per_worker: int = GpusOpt):
    """Cancel the experiment's pending and running jobs and stop its luigid.

    What is done stays done; a rerun of the launcher runs the rest."""
    _check_tools()
    wf, rec_path, rec = _find(workflow, config, set, preset, outputs, gpus_per_worker)
    ids = [la["array_job"] for la in rec["launches"] if la.get("array_job")]
    running = active_jobs(rec)
    if running:
        try:
            slurm("scancel", *sorted({j.split("_")[0] for j in running}))
        except UsageError as e:  # e.g. not the jobs' owner, or the controller does not answer
            fail(f"{e}; the jobs {', '.join(running)} were not cancelled")
        typer.echo(f"cancelled {', '.join(running)}")
        for _ in range(120):  # scancel returns at once; wait for the jobs to end (KillWait)
            if not active_jobs(rec):
                break
            time.sleep(0.5)
    else:
        typer.echo("no job pending or running")
    for la in rec["launches"]:
        if stop_luigid(la.get("luigid") or {}):
            typer.echo(f"stopped luigid (pid on {la['luigid']['started_on']})")
    save_record(rec_path, rec)
    print_jobs(job_states(ids) if ids else {}, rec_path.parent)
