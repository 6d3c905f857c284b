"""Talking to Slurm and running luigid, for ``zerograph slurm`` (:mod:`workflows.slurm`): the Slurm
client commands it needs (``sinfo``, ``scontrol``, ``sacct``), where luigid runs and how it is stopped,
and the sbatch script of the worker jobs. No Typer here: every failure a user can fix is a
:class:`UsageError` with a one-line message."""
from __future__ import annotations

import configparser
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the repository root: workers run from here
SLURM_TOOLS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
          "SUSPENDED", "STAGE_OUT", "SIGNALING", "PREEMPTED"}
# Filesystems and folders that are never shared between nodes.
LOCAL_FS = {"tmpfs", "ramfs", "devtmpfs", "overlay"}
LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
REQUEUE_SIGNAL = "USR1@90"  # --signal=B:USR1@90: 90 s before the time limit the job requeues itself


class UsageError(Exception):
    """Bad launcher input, found before anything is submitted: one line, exit 2."""


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


def partition_nodes(partition: str | None) -> list[str]:
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


def local_folder_reason(path: Path) -> str | None:
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
    return dict(sorted(out.items(), key=lambda kv: [int(p) if p.isdigit() else -1 for p in kv[0].split("_")]))


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
                  partition: str | None, time_limit: str | None, mem: str | None, sched_host: str,
                  sched_port: int | str, name: str, extra: list[str], tasks: int = 1) -> str:
    """The sbatch script of the worker job array (one array element per worker job).

    Each element runs one ``luigi`` worker per GPU Slurm gave it (``CUDA_VISIBLE_DEVICES``), or one
    on CPU, with ``OMP_NUM_THREADS`` = the job's CPUs / workers. 90 s before the time limit Slurm
    sends USR1 (``--signal=B:USR1@90``) and the job requeues itself (``--requeue`` also lets Slurm
    requeue it on preemption or node failure); an interrupted ``TrainBlock`` resumes from its checkpoint.
    The script stops at the first command that fails (``set -Eeuo pipefail``), naming it in the job's log.
    ``sched_port`` may be a placeholder string (``--dry-run`` without a cluster). ``tasks`` > 1 gives
    each job that many Slurm tasks (``--ntasks``; the luigi worker runs once, in the batch step): a
    pipelined local-learning run (``train.execution = "pipeline"``) starts its K stages as the tasks
    of one ``srun`` (:mod:`zgcore.local.pipeline`)."""
    place = ["--nodes=1", "--ntasks=1"] if tasks == 1 else [f"--ntasks={tasks}"]
    sb = [f"--job-name={name}", f"--array=0-{workers - 1}", f"--cpus-per-task={cpus}", *place,
          f"--output={folder}/logs/worker-%A_%a.log", "--open-mode=append", "--requeue",
          f"--signal=B:{REQUEUE_SIGNAL}"]
    if partition:
        sb.append(f"--partition={partition}")
    if time_limit:
        sb.append(f"--time={time_limit}")
    if mem:
        sb.append(f"--mem={mem}")
    if gpus:
        sb.append(f"--gres=gpu:{gpus}" if tasks == 1 else f"--gpus-per-task={max(1, gpus // tasks)}")
    cmd = shlex.join([sys.executable, "-m", "luigi", "--module", "workflows", workflow, "--scheduler-host", sched_host,
                      "--scheduler-port", str(sched_port), "--no-lock", "--workers", "1", *options])
    head = "\n".join(f"#SBATCH {a}" for a in [*sb, *extra])
    return f"""#!/bin/bash
{head}
# Written by `zerograph slurm` (workflows/slurm.py) for {folder.name}.
# Stop at the first command that fails, with a line in this log saying which.
set -Eeuo pipefail
trap 'echo "error: zerograph worker on $(hostname): line $LINENO: $BASH_COMMAND failed (exit $?)" >&2' ERR
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
  kill -TERM "${{pids[@]}}" 2>/dev/null || true
  scontrol requeue "$SLURM_JOB_ID" || echo "zerograph worker: scontrol requeue $SLURM_JOB_ID failed" >&2
}}
trap requeue USR1
rc=0
for p in "${{pids[@]}}"; do
  while kill -0 "$p" 2>/dev/null; do wait "$p" || true; done  # a trapped signal ends a wait early
  code=0; wait "$p" || code=$?; [ $code -eq 0 ] || rc=$code
done
echo "zerograph worker: luigi exited $rc (the launcher judges the experiment from its outputs)"
exit $rc
"""
