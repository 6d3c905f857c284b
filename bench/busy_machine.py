"""The tiny preset on a busy machine: wall time of the README's one-minute command with one
core kept busy by another process, divided by its time on the same machine without that process.

    python bench/busy_machine.py [--repeats 3] [--json out.json]

Each run is the whole `luigi --module workflows RunExperiment --local-scheduler --preset tiny` command,
from an empty outputs folder (imports, the ten tasks, the report), as a user runs it. Conditions, all
measured in this one run and interleaved (idle, busy, idle, busy, ...) so that a change of the
machine's load over time hits both alike:

* ``chosen``: threads chosen per task (zgcore.threads; 1 for the tiny model), no OMP_NUM_THREADS;
* ``all cores``: ``--zerograph-threads <usable cores>``, torch's own default (one thread per core) — the
  behaviour before threads were chosen per task.

"Busy" is one process spinning on one core (``while True: pass``) for the whole run.
Target: chosen busy / chosen idle <= 1.5. The median and the minimum of ``--repeats`` runs are
reported (on a machine that other jobs share, the minimum is the least disturbed run), with the CPU
seconds (user + system) the command used: threads that wait for a busy core spin and burn CPU.
"""
from __future__ import annotations

import argparse
import json
import resource
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from zgcore.threads import usable_cores  # noqa: E402

TARGET = 1.5


def run_tiny(work: Path, threads: int | None) -> tuple[float, float]:
    """``(wall, cpu)`` seconds of the tiny preset from an empty outputs folder in ``work`` (cpu: user +
    system time of the command and its children)."""
    out = work / "outputs"
    shutil.rmtree(out, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "luigi", "--module", "workflows", "RunExperiment", "--local-scheduler",
           "--preset", "tiny", "--outputs", str(out)]
    if threads:
        cmd += ["--zerograph-threads", str(threads)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise RuntimeError(f"tiny preset failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="", help="write the figures here too")
    args = ap.parse_args()
    cores = usable_cores()
    times: dict[str, list[tuple[float, float]]] = {f"{mode} {load}": [] for mode in ("chosen", "all cores")
                                                   for load in ("idle", "busy")}
    with tempfile.TemporaryDirectory(prefix="zg-busy-") as d:
        work = Path(d)
        shutil.copy(REPO / "luigi.cfg", work / "luigi.cfg")
        run_tiny(work, None)  # warm the file cache (python, torch, the tiny teacher's code)
        for _ in range(args.repeats):
            for load in ("idle", "busy"):
                spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
                try:
                    for mode, threads in (("chosen", None), ("all cores", cores)):
                        times[f"{mode} {load}"].append(run_tiny(work, threads))
                finally:
                    if spinner is not None:
                        spinner.kill()
                        spinner.wait()
    med = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    low = {k: min(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    print(f"usable cores: {cores}; {args.repeats} repeats; wall seconds of the tiny preset (median, min; "
          "CPU seconds median; each run):")
    for k, v in times.items():
        print(f"  {k:<16} {med[k]:6.1f} {low[k]:6.1f}   cpu {cpu[k]:6.1f}   ({', '.join(f'{w:.1f}' for w, _ in v)})")
    ratio = {s: d["chosen busy"] / d["chosen idle"] for s, d in (("median", med), ("min", low))}
    before = {s: d["all cores busy"] / d["all cores idle"] for s, d in (("median", med), ("min", low))}
    for s in ("median", "min"):
        print(f"{s:>6}: chosen threads busy / idle = {ratio[s]:.2f} (target <= {TARGET}: "
              f"{'met' if ratio[s] <= TARGET else 'NOT met'}); all cores busy / idle = {before[s]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cores": cores, "times": times, "median": med, "min": low, "cpu": cpu,
                                               "ratio": ratio, "ratio_all_cores": before}, indent=2))


if __name__ == "__main__":
    main()
