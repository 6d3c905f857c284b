"""The launcher's pre-flight check (:func:`preflight`): before the worker array is submitted, one
short job on the partition (``srun``, waited for) checks that a compute node sees what the worker
jobs will need — the repository, the Python they run, the outputs folder (writable: the job logs
go there) — and can connect to luigid where the workers will. Any failure is one
:class:`~workflows.slurm_cluster.UsageError` line (exit 2 in the launcher); nothing is submitted."""
from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from .slurm_cluster import ROOT, UsageError

PROBE_TAG = "zerograph-probe:"
PROBE_TIME = "00:05:00"  # the probe's own time limit


def probe_script(folder: Path, sched_host: str, sched_port: int, python: str = sys.executable) -> str:
    """The bash the probe runs on a node: each check prints ``zerograph-probe: <node>: <what is
    wrong>`` and exits 3 at the first failure; ``zerograph-probe: ok <node>`` when all pass."""
    q = shlex.quote
    connect = (f"import socket; socket.create_connection(({sched_host!r}, {int(sched_port)}), timeout=10).close()")
    return f"""set -u
fail() {{ echo "{PROBE_TAG} $(hostname): $*"; exit 3; }}
cd {q(str(ROOT))} 2>/dev/null || fail "does not see the repository {ROOT}"
[ -x {q(python)} ] || fail "does not see the Python the jobs run, {python}"
{q(python)} -c 'import luigi' 2>/dev/null || fail "cannot import luigi with {python}"
[ -e {q(str(folder / 'launch.json'))} ] || fail "does not see the outputs folder ({folder / 'launch.json'} is missing there): --outputs must be a folder every node mounts at the same path"
probe={q(str(folder / 'logs'))}/.probe-$(hostname)-$$
( : > "$probe" && rm -f "$probe" ) 2>/dev/null || fail "cannot write the job logs folder {folder / 'logs'}"
{q(python)} -c {q(connect)} 2>/dev/null || fail "cannot connect to luigid at {sched_host}:{sched_port} (a firewall, a wrong --scheduler-host, or luigid not running)"
echo "{PROBE_TAG} ok $(hostname)"
"""


def preflight(folder: Path, sched_host: str, sched_port: int, partition: str | None, extra: list[str],
              timeout_s: float = 600.0) -> str:
    """Run :func:`probe_script` on one node of ``partition`` with ``srun`` (``extra``: the launch's
    own sbatch options, e.g. ``--account``), waiting at most ``timeout_s`` for a node and the
    checks; returns the node's name.

    Raises:
        UsageError: a check failed (the message says which, on which node), srun failed, or no
            node answered in time.
    """
    args = ["srun", "--nodes=1", "--ntasks=1", "--cpus-per-task=1", f"--time={PROBE_TIME}", "--job-name=zg-probe",
            "--quiet", *( [f"--partition={partition}"] if partition else []), *extra,
            "bash", "-c", probe_script(folder, sched_host, sched_port)]
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        raise UsageError(f"pre-flight: no node of the partition ran the {PROBE_TIME} probe within {timeout_s:.0f} s "
                         "(the partition is busy or down); nothing submitted") from None
    except OSError as e:
        raise UsageError(f"pre-flight: srun could not run ({e}); nothing submitted") from None
    said = [ln.split(PROBE_TAG, 1)[1].strip() for ln in r.stdout.splitlines() if PROBE_TAG in ln]
    if r.returncode == 0 and said and said[-1].startswith("ok "):
        return said[-1][3:]
    if said:
        raise UsageError(f"pre-flight on the partition: {said[-1]}; nothing submitted")
    first = next((ln.strip() for ln in (r.stderr + r.stdout).splitlines() if ln.strip()), f"exit {r.returncode}")
    raise UsageError(f"pre-flight: srun failed: {first}; nothing submitted")
