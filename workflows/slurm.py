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

import configparser
import datetime as _dt
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import luigi
import typer
import typer.core
from luigi.task import flatten

from . import RETCODES
from .experiment import CONFIG_ERROR_EXIT, or_exit

ROOT = Path(__file__).resolve().parents[1]  # the repository root: workers run from here
SLURM_TOOLS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
          "SUSPENDED", "STAGE_OUT", "SIGNALING", "PREEMPTED"}
# Filesystems and folders that are never shared between nodes.
LOCAL_FS = {"tmpfs", "ramfs", "devtmpfs", "overlay"}
LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
# A worker's exit code, named (luigi.cfg [retcode]); 2 is the job script's own "outputs not shared".
LUIGI_CODES = {code: name for name, code in RETCODES.items()} | {2: "configuration error or outputs not shared"}
REQUEUE_SIGNAL = "USR1@90"  # --signal=B:USR1@90: 90 s before the time limit the job requeues itself


class UsageError(Exception):
    """Bad launcher input, found before anything is submitted: one line, exit 2."""


def fail(msg: str) -> None:
    """Print ``error: msg`` on stderr and exit :data:`CONFIG_ERROR_EXIT` (2)."""
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(CONFIG_ERROR_EXIT)


# --- the workflow ------------------------------------------------------------------------------

def workflow_classes() -> dict[str, type]:
    """The top-level workflows a launch can run, by name (``RunExperiment``, ``ObjectiveStudy``, ...)."""
    import workflows
    from .experiment import ConfiguredWorkflow

    return {name: obj for name in workflows.__all__ if isinstance(obj := getattr(workflows, name), type)
            and issubclass(obj, ConfiguredWorkflow) and name != "PrepareInputs"}


def experiment_options(config: str, set_: str, preset: Optional[str], outputs: str) -> list[str]:
    """The workflow's command-line options as given (``--preset`` only when given, so each workflow
    keeps its own default)."""
    args = ["--outputs", outputs]
    for flag, value in (("--preset", preset), ("--config", config), ("--set", set_)):
        if value is not None and (value != "" or flag == "--preset"):
            args += [flag, value]
    return args


def make_workflow(name: str, config: str, set_: str, preset: Optional[str], outputs: str):
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
    from .cli import walk  # here: cli.py imports this module to register `zerograph slurm`

    seen: dict[str, Any] = {}
    for root in flatten(wf.requires()):
        for t in walk(root):
            seen.setdefault(t.task_id, t)
    return list(seen.values())


def missing_tasks(wf) -> list:
    """The workflow's tasks whose outputs are not complete (``[]``: the workflow is done)."""
    return [t for t in walk_all(wf) if not t.complete()]


def reports(wf) -> list[Path]:
    """The report of each root task (``report.md`` in its folder, else the folder)."""
    out = []
    for t in flatten(wf.requires()):
        d = Path(t.out_dir)
        out.append(d / "report.md" if (d / "report.md").is_file() else d)
    return out


class PrepareFor(luigi.WrapperTask):
    """The teacher and corpus tasks of one workflow (:func:`prepare_tasks`): what the launcher runs
    on the submitting host with ``luigi --module workflows.slurm PrepareFor --local-scheduler``."""

    workflow = luigi.Parameter()
    config = luigi.Parameter(default="")
    set = luigi.Parameter(default="")
    preset = luigi.OptionalParameter(default=None)
    outputs = luigi.Parameter()

    def requires(self):
        return prepare_tasks(make_workflow(self.workflow, self.config, self.set, self.preset, self.outputs))


# --- Slurm -------------------------------------------------------------------------------------

def slurm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a Slurm client command; with ``check`` a failure raises :class:`UsageError` with its
    first stderr line."""
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        first = next((ln for ln in (r.stderr or r.stdout).splitlines() if ln.strip()), f"exit {r.returncode}")
        raise UsageError(f"{args[0]} failed: {first.strip()}")
    return r


def hostnames(expr: str) -> list[str]:
    """Expand a Slurm host list (``node[01-03]``) with ``scontrol show hostnames``."""
    return slurm("scontrol", "show", "hostnames", expr).stdout.split() if expr.strip() else []


def partition_nodes(partition: Optional[str]) -> list[str]:
    """The nodes of ``partition`` (the default partition when None).

    Raises:
        UsageError: no such partition (the message lists those ``sinfo`` shows).
    """
    rows = [ln.split() for ln in slurm("sinfo", "-h", "-o", "%P %N").stdout.splitlines() if ln.strip()]
    known = {p.rstrip("*"): (p, n) for p, n in rows}
    if partition is None:
        default = [k for k, (p, _) in known.items() if p.endswith("*")]
        if not default:
            raise UsageError(f"the cluster has no default partition: pass --partition (sinfo lists: {', '.join(known)})")
        partition = default[0]
    if partition not in known:
        raise UsageError(f"no partition {partition!r} on this cluster (sinfo lists: {', '.join(sorted(known)) or 'none'})")
    return hostnames(known[partition][1])


def local_folder_reason(path: Path) -> Optional[str]:
    """Why ``path`` is certainly not shared between nodes (a tmpfs, /tmp, ...), or None."""
    p = str(path)
    tmpdirs = [*LOCAL_DIRS, *([os.environ["TMPDIR"]] if os.environ.get("TMPDIR", "").startswith("/") else [])]
    for d in tmpdirs:
        if p == d or p.startswith(d.rstrip("/") + "/"):
            return f"it is under {d}, which is local to each node"
    best, fstype = "", ""
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3:
                mnt = parts[1].replace("\\040", " ")
                if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        return None
    return f"it is on a {fstype} filesystem ({best}), local to each node" if fstype in LOCAL_FS else None


def this_host() -> str:
    """This host's name as other nodes reach it: its FQDN when that extends its hostname (not
    ``localhost``), else the hostname."""
    name, fqdn = socket.gethostname(), socket.getfqdn()
    return fqdn if fqdn.startswith(short_host(name) + ".") else name


def scheduler_address(nodes: list[str]) -> str:
    """The name the worker jobs reach luigid on this host by: :func:`this_host` when it resolves;
    ``127.0.0.1`` when it does not and this host is the partition's only node.

    Raises:
        UsageError: the name does not resolve and the partition has other nodes.
    """
    host = this_host()
    try:
        socket.gethostbyname(host)
        return host
    except OSError:
        if {short_host(n) for n in nodes} == {short_host(socket.gethostname())}:
            return "127.0.0.1"
        raise UsageError(f"this host's name {host!r} does not resolve: pass --scheduler-host with a name or "
                         f"address the nodes reach it by") from None


def short_host(name: str) -> str:
    """``node017.cluster.org`` -> ``node017``."""
    return name.split(".")[0]


def job_states(array_ids: list[str]) -> dict[str, dict[str, str]]:
    """Each array element's state: ``{"<array>_<i>": {"state", "exit", "node", "reason"}}``.

    Asks ``scontrol show job`` (Slurm keeps finished jobs for ``MinJobAge``, 5 min by default),
    then ``sacct`` for jobs scontrol no longer knows; a job neither knows is ``UNKNOWN``."""
    out: dict[str, dict[str, str]] = {}
    for aid in array_ids:
        r = slurm("scontrol", "-o", "show", "job", aid, check=False)
        recs = [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in r.stdout.splitlines()]
        recs = [x for x in recs if x.get("ArrayJobId") == aid or x.get("JobId") == aid]
        if not recs:
            s = slurm("sacct", "-n", "-P", "-X", "-j", aid, "-o", "JobID,State,ExitCode,NodeList", check=False)
            for line in s.stdout.splitlines() if s.returncode == 0 else []:
                jid, state, code, node = (line.split("|") + ["", "", "", ""])[:4]
                if "_" in jid and "[" not in jid:
                    out[jid] = {"state": state.split()[0], "exit": code, "node": node, "reason": ""}
            if not any(k.startswith(aid + "_") for k in out):
                out[f"{aid}_*"] = {"state": "UNKNOWN", "exit": "", "node": "",
                                   "reason": "Slurm no longer knows this job (see its log)"}
            continue
        for x in recs:
            tasks_ = x.get("ArrayTaskId", "0")
            for i in expand_range(tasks_):
                out[f"{aid}_{i}"] = {"state": x.get("JobState", "?"), "exit": x.get("ExitCode", ""),
                                     "node": x.get("NodeList", "") if x.get("NodeList") != "(null)" else "",
                                     "reason": x.get("Reason", "") if x.get("Reason") != "None" else ""}
    return dict(sorted(out.items(), key=lambda kv: [int(p) if p.isdigit() else 0 for p in re.split(r"[_]", kv[0])]))


def expand_range(spec: str) -> list[int]:
    """``"0-3,5%2"`` -> [0, 1, 2, 3, 5] (Slurm's array-index syntax, the ``%`` limit dropped)."""
    out: list[int] = []
    for part in spec.split("%")[0].split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            out += range(int(lo), int(hi.split(":")[0]) + 1)
        elif part.strip().isdigit():
            out.append(int(part))
    return out


# --- luigid on the submitting host -------------------------------------------------------------

def luigi_cfg_path() -> Path:
    """The Luigi config the launcher, luigid and the workers read: ``$LUIGI_CONFIG_PATH``, else the
    repository's ``luigi.cfg``."""
    return Path(os.environ.get("LUIGI_CONFIG_PATH") or ROOT / "luigi.cfg").resolve()


def write_luigid_cfg(folder: Path, gpus: int) -> tuple[Path, int]:
    """A copy of :func:`luigi_cfg_path` for luigid, with ``[resources] gpu = gpus`` when the file
    sets none and ``gpus > 0``; returns the path and the GPU limit luigid will apply."""
    parser = configparser.ConfigParser()
    parser.read(luigi_cfg_path())
    if gpus and not parser.has_option("resources", "gpu"):
        if not parser.has_section("resources"):
            parser.add_section("resources")
        parser.set("resources", "gpu", str(gpus))
    limit = parser.getint("resources", "gpu", fallback=1)
    path = folder / "luigid.cfg"
    with open(path, "w") as f:
        parser.write(f)
    return path, limit


def free_port() -> int:
    """A TCP port free on every interface of this host a moment ago."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def luigid_answers(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether something accepts TCP connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def start_luigid(folder: Path, port: int, cfg: Path, timeout_s: float = 60.0) -> int:
    """Start luigid detached from this process (its own session: it outlives the launcher), on
    ``port`` of every interface, its state and logs in ``folder``; wait until it answers. Returns its pid.

    Raises:
        UsageError: luigid exited or did not answer within ``timeout_s``.
    """
    exe = shutil.which("luigid", path=str(Path(sys.executable).parent)) or shutil.which("luigid")
    if not exe:
        raise UsageError("no luigid next to this Python or on PATH: pip install luigi")
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    state = folder / "luigid-state.pickle"
    state.unlink(missing_ok=True)  # a fresh scheduler: no task stays failed/disabled from an earlier launch
    log = open(folder / "logs" / "luigid.log", "a")
    proc = subprocess.Popen([exe, "--port", str(port), "--state-path", str(state), "--logdir", str(folder / "logs")],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=folder,
                            env={**os.environ, "LUIGI_CONFIG_PATH": str(cfg)}, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UsageError(f"luigid exited with code {proc.returncode} (see {folder / 'logs' / 'luigid.log'})")
        if luigid_answers("127.0.0.1", port, 0.5):
            return proc.pid
        time.sleep(0.1)
    proc.terminate()
    raise UsageError(f"luigid did not answer on port {port} within {timeout_s:.0f} s")


def stop_luigid(info: dict[str, Any]) -> bool:
    """Stop the luigid a launch started, if it runs on this host and is still that process
    (its command line names this experiment's state file). Returns whether one was stopped."""
    pid = info.get("pid")
    if not pid or info.get("started_on") != socket.gethostname():
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    if "luigid" not in cmdline or str(info.get("state", "\0")) not in cmdline:
        return False
    os.kill(pid, signal.SIGTERM)
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except OSError:
            break
        time.sleep(0.05)
    info["pid"] = None
    return True


# --- the job script ----------------------------------------------------------------------------

def worker_script(folder: Path, workflow: str, options: list[str], *, workers: int, gpus: int, cpus: int,
                  partition: Optional[str], time_limit: Optional[str], mem: Optional[str], sched_host: str,
                  sched_port: int, name: str, extra: list[str]) -> str:
    """The sbatch script of the worker job array (one array element per worker job).

    Each element runs one ``luigi`` worker per GPU Slurm gave it (``CUDA_VISIBLE_DEVICES``), or one
    on CPU, with ``OMP_NUM_THREADS`` = the job's CPUs / workers. 90 s before the time limit Slurm
    sends USR1 (``--signal=B:USR1@90``) and the job requeues itself (``--requeue`` also lets Slurm
    requeue it on preemption or node failure); an interrupted ``TrainBlock`` resumes from its checkpoint."""
    sb = [f"--job-name={name}", f"--array=0-{workers - 1}", f"--cpus-per-task={cpus}", "--nodes=1", "--ntasks=1",
          f"--output={folder}/logs/worker-%A_%a.log", "--open-mode=append", "--requeue",
          f"--signal=B:{REQUEUE_SIGNAL}"]
    if partition:
        sb.append(f"--partition={partition}")
    if time_limit:
        sb.append(f"--time={time_limit}")
    if mem:
        sb.append(f"--mem={mem}")
    if gpus:
        sb.append(f"--gres=gpu:{gpus}")
    cmd = shlex.join([sys.executable, "-m", "luigi", "--module", "workflows", workflow, "--scheduler-host", sched_host,
                      "--scheduler-port", str(sched_port), "--no-lock", "--workers", "1", *options])
    head = "\n".join(f"#SBATCH {a}" for a in [*sb, *extra])
    return f"""#!/bin/bash
{head}
# Written by `zerograph slurm` (workflows/slurm.py) for {folder.name}.
set -u
cd {shlex.quote(str(ROOT))}
export LUIGI_CONFIG_PATH={shlex.quote(str(luigi_cfg_path()))} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ ! -e {shlex.quote(str(folder / 'launch.json'))} ]; then
  echo "error: $(hostname) does not see {folder}: --outputs must be a folder shared by every node" >&2
  exit 2
fi
slots=(all)  # one luigi worker per GPU Slurm gave this job, each seeing only its own as `cuda`
if [ {gpus} -gt 0 ] && [ -n "${{CUDA_VISIBLE_DEVICES:-}}" ]; then IFS=, read -ra slots <<< "$CUDA_VISIBLE_DEVICES"; fi
threads=$(( ${{SLURM_CPUS_PER_TASK:-1}} / ${{#slots[@]}} )); [ "$threads" -ge 1 ] || threads=1
export OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads
echo "zerograph worker: job ${{SLURM_JOB_ID:-?}} (${{SLURM_ARRAY_JOB_ID:-?}}_${{SLURM_ARRAY_TASK_ID:-?}}) on $(hostname)," \\
     "restart ${{SLURM_RESTART_COUNT:-0}}, ${{#slots[@]}} worker(s) of $threads thread(s), CUDA_VISIBLE_DEVICES=${{CUDA_VISIBLE_DEVICES:-}}"
pids=()
for slot in "${{slots[@]}}"; do
  if [ "$slot" != all ]; then export CUDA_VISIBLE_DEVICES=$slot; fi
  {cmd} &
  pids+=($!)
done
requeue() {{
  echo "zerograph worker: time limit near, requeueing job $SLURM_JOB_ID (a TrainBlock resumes from its checkpoint)"
  kill -TERM "${{pids[@]}}" 2>/dev/null
  scontrol requeue "$SLURM_JOB_ID"
}}
trap requeue USR1
rc=0
for p in "${{pids[@]}}"; do
  while kill -0 "$p" 2>/dev/null; do wait "$p"; done
  wait "$p"; code=$?; [ $code -eq 0 ] || rc=$code
done
echo "zerograph worker: luigi exited $rc (the launcher judges the experiment from its outputs)"
exit $rc
"""


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


# --- the commands ------------------------------------------------------------------------------

class WorkflowFirst(typer.core.TyperGroup):
    """``zerograph slurm RunExperiment ...`` means ``zerograph slurm launch RunExperiment ...``."""

    def resolve_command(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["launch", *args]
        return super().resolve_command(ctx, args)


app = typer.Typer(cls=WorkflowFirst, add_completion=False, no_args_is_help=True,
                  help="Run a workflow on a Slurm cluster: luigid here, N worker jobs (docs/slurm.md).")

ConfigOpt = typer.Option("", "--config", "-c", help="experiment file (.toml/.yaml)")
SetOpt = typer.Option("", "--set", "-s", help='overrides, e.g. "train.lr=1e-4 blocks.1.lr=5e-5"')
PresetOpt = typer.Option(None, "--preset", "-p", help="preset in workflows/presets (default: the workflow's)")
OutputsOpt = typer.Option(..., "--outputs", "-o", help="root folder of run artifacts: absolute, shared by every node")
WorkflowArg = typer.Argument("RunExperiment", help="RunExperiment, ObjectiveStudy, LocalLearningStudy or DistillStudy")


def _check_tools() -> None:
    missing = [t for t in SLURM_TOOLS if not shutil.which(t)]
    if missing:
        fail(f"{', '.join(missing)} not on PATH: run this on a Slurm login node (or start a test cluster: scripts/slurm_local.sh start)")


def _resolve(workflow: str, config: str, set_: str, preset: Optional[str], outputs: str, gpus: int,
             launching: bool = True):
    """Check the outputs path (and, ``launching``, the device against the GPUs asked for), then
    build the workflow; returns (the ``--set`` string with ``device=cuda`` added for GPUs, the
    workflow task, the experiment id). Exits 2 on bad input."""
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
           mem: Optional[str] = typer.Option(None, "--mem", help="memory per job, e.g. 32G (--mem)"),
           partition: Optional[str] = typer.Option(None, "--partition", help="Slurm partition (default: the cluster's)"),
           time_limit: Optional[str] = typer.Option(None, "--time", help="time limit per job, e.g. 04:00:00"),
           config: str = ConfigOpt, set: str = SetOpt, preset: Optional[str] = PresetOpt, outputs: str = OutputsOpt,
           detach: bool = typer.Option(False, "--detach", help="return once the jobs are submitted"),
           sbatch_args: str = typer.Option("", "--sbatch", help='more sbatch options, e.g. "--account=abc --qos=high"'),
           scheduler_host: Optional[str] = typer.Option(None, "--scheduler-host",
                                                        help="this host's name as the nodes reach it (default: its FQDN)"),
           scheduler_port: int = typer.Option(0, "--scheduler-port", help="luigid's port (default: a free one)"),
           poll: float = typer.Option(5.0, "--poll", help="seconds between job-state checks while waiting"),
           dry_run: bool = typer.Option(False, "--dry-run", help="print the job script; start and submit nothing")):
    """Prepare the inputs here, start luigid here, submit N worker jobs, wait for them.

    Exits 0 when every task of the workflow is complete, 1 when the jobs ended with work left
    (rerun the same command: only what is missing runs), 2 on bad input (nothing submitted)."""
    _check_tools()
    set_, wf, exp = _resolve(workflow, config, set, preset, outputs, gpus_per_worker)
    try:
        nodes = partition_nodes(partition)
        reason = local_folder_reason(Path(outputs))
        if reason and {short_host(n) for n in nodes} != {short_host(socket.gethostname())}:
            raise UsageError(f"--outputs {outputs} is not shared by the nodes of the partition: {reason}")
    except UsageError as e:
        fail(str(e))
    folder = Path(outputs) / "slurm" / exp
    options = experiment_options(config, set_, preset, outputs)
    extra = shlex.split(sbatch_args)
    try:
        sched_host = scheduler_host or scheduler_address(nodes)
    except UsageError as e:
        fail(str(e))
    port = scheduler_port or free_port()
    script = worker_script(folder, workflow, options, workers=workers, gpus=gpus_per_worker, cpus=cpus_per_worker,
                           partition=partition, time_limit=time_limit, mem=mem, sched_host=sched_host,
                           sched_port=port, name=f"zg-{exp}"[:60], extra=extra)
    if dry_run:
        typer.echo(f"# experiment {exp}; would write {folder}/worker.sbatch and run: sbatch --parsable {folder}/worker.sbatch")
        typer.echo(script)
        return
    test = subprocess.run(["sbatch", "--test-only"], input=script, capture_output=True, text=True, timeout=120)
    if test.returncode != 0:
        fail(f"sbatch refused the job: {(test.stderr.strip().splitlines() or ['?'])[-1]}")
    rec_path = folder / "launch.json"
    rec = load_record(rec_path)
    try:
        running = active_jobs(rec)
    except UsageError as e:
        fail(str(e))
    if running:
        fail(f"jobs {', '.join(running)} of {exp} are still pending or running: wait for them "
             f"(zerograph slurm status) or cancel them (zerograph slurm cancel), then rerun")
    stop_idle_luigids(rec)
    if not missing_tasks(wf):
        typer.echo(f"{exp}: already complete, nothing submitted")
        for r in reports(wf):
            typer.echo(f"report: {r}")
        return
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    script_path = folder / "worker.sbatch"
    script_path.write_text(script)

    rec.update(experiment=exp, workflow=workflow, options=options, root=str(ROOT))
    save_record(rec_path, rec)  # the job script checks that it sees this file (a shared folder)
    typer.echo(f"{exp}: preparing the teacher and corpus here (log: {folder / 'logs' / 'prepare.log'})")
    _prepare(workflow, config, set_, preset, outputs, folder)

    cfg, gpu_limit = write_luigid_cfg(folder, workers * gpus_per_worker)
    if gpus_per_worker and gpu_limit < workers * gpus_per_worker:
        typer.echo(f"warning: {luigi_cfg_path()} sets [resources] gpu = {gpu_limit}: at most {gpu_limit} GPU tasks "
                   f"run at once of the {workers * gpus_per_worker} GPUs asked for", err=True)
    try:
        pid = start_luigid(folder, port, cfg)
    except UsageError as e:
        fail(str(e))
    launch_rec = {"time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "workers": workers,
                  "script": str(script_path),
                  "luigid": {"host": sched_host, "port": port, "pid": pid, "started_on": socket.gethostname(),
                             "state": str(folder / "luigid-state.pickle"), "config": str(cfg)}}
    r = slurm("sbatch", "--parsable", str(script_path), check=False)
    if r.returncode != 0:
        stop_luigid(launch_rec["luigid"])
        fail(f"sbatch failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    launch_rec["array_job"] = r.stdout.strip().split(";")[0]
    rec["launches"].append(launch_rec)
    save_record(rec_path, rec)
    typer.echo(f"submitted job array {launch_rec['array_job']} ({workers} worker jobs); "
               f"luigid: http://{sched_host}:{port}  records: {folder}")
    if detach:
        typer.echo(f"follow it with: zerograph slurm status {_cmd_options(workflow, options)}")
        return
    raise typer.Exit(_wait(wf, rec, rec_path, folder, poll, workflow, options))


def _cmd_options(workflow: str, options: list[str]) -> str:
    """The workflow and its options as one shell-quoted string."""
    return shlex.join([workflow, *options])


def _prepare(workflow: str, config: str, set_: str, preset: Optional[str], outputs: str, folder: Path) -> None:
    """Build the workflow's teacher and corpus here (``PrepareFor`` with Luigi's local scheduler);
    exits 1 with the log's tail when that fails."""
    args = [sys.executable, "-m", "luigi", "--module", "workflows.slurm", "PrepareFor", "--local-scheduler", "--no-lock",
            "--workflow", workflow, "--config", config, "--set", set_, "--outputs", outputs]
    if preset is not None:
        args += ["--preset", preset]
    log = folder / "logs" / "prepare.log"
    with open(log, "a") as f:
        r = subprocess.run(args, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           env={**os.environ, "LUIGI_CONFIG_PATH": str(luigi_cfg_path())})
    if r.returncode != 0:
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
               f"{', '.join(f'{t.get_task_family()} {t.label()}' for t in missing[:4])}; see the job logs above, "
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
def status(workflow: str = WorkflowArg, config: str = ConfigOpt, set: str = SetOpt, preset: Optional[str] = PresetOpt,
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
def cancel(workflow: str = WorkflowArg, config: str = ConfigOpt, set: str = SetOpt, preset: Optional[str] = PresetOpt,
           outputs: str = OutputsOpt, gpus_per_worker: int = GpusOpt):
    """Cancel the experiment's pending and running jobs and stop its luigid.

    What is done stays done; a rerun of the launcher runs the rest."""
    _check_tools()
    wf, rec_path, rec = _find(workflow, config, set, preset, outputs, gpus_per_worker)
    ids = [la["array_job"] for la in rec["launches"] if la.get("array_job")]
    running = active_jobs(rec)
    if running:
        slurm("scancel", *sorted({j.split("_")[0] for j in running}))
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
