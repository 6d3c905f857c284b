"""The tiny preset on a busy machine (issue 21): wall time of the README's one-minute command with one
core kept busy by another process, divided by its time on the same machine without that process.

    python bench/busy_machine.py [--repeats 3] [--json out.json]

Each run is the whole `luigi --module workflows RunExperiment --local-scheduler --preset tiny` command,
from an empty outputs folder (imports, the ten tasks, the report), as a user runs it. Conditions, all
measured in this one run and interleaved (idle, busy, idle, busy, ...) so that a change of the
machine's load over time hits both alike:

* ``chosen``: threads chosen per task (zgcore.threads; 1 for the tiny model), no OMP_NUM_THREADS;
* ``all cores``: ``--zerograph-threads <usable cores>``, torch's own default (one thread per core) — the
  behaviour before issue 21.

"Busy" is one process spinning on one core (``while True: pass``) for the whole run.
Target: chosen busy / chosen idle <= 1.5. The median of ``--repeats`` runs is reported.
"""
from __future__ import annotations

import argparse
import json
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


def run_tiny(work: Path, threads: int | None) -> float:
    """Seconds of wall time of the tiny preset from an empty outputs folder in ``work``."""
    out = work / "outputs"
    shutil.rmtree(out, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "luigi", "--module", "workflows", "RunExperiment", "--local-scheduler",
           "--preset", "tiny", "--outputs", str(out)]
    if threads:
        cmd += ["--zerograph-threads", str(threads)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"tiny preset failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="", help="write the figures here too")
    args = ap.parse_args()
    cores = usable_cores()
    times: dict[str, list[float]] = {f"{mode} {load}": [] for mode in ("chosen", "all cores") for load in ("idle", "busy")}
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
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"usable cores: {cores}; {args.repeats} repeats; median wall seconds of the tiny preset:")
    for k, v in times.items():
        print(f"  {k:<16} {med[k]:6.1f} s   ({', '.join(f'{x:.1f}' for x in v)})")
    ratio = med["chosen busy"] / med["chosen idle"]
    before = med["all cores busy"] / med["all cores idle"]
    print(f"chosen threads: busy / idle = {ratio:.2f} (target <= {TARGET}: {'met' if ratio <= TARGET else 'NOT met'})")
    print(f"all cores (torch's default): busy / idle = {before:.2f}; busy, all cores / chosen = "
          f"{med['all cores busy'] / med['chosen busy']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cores": cores, "times": times, "median": med, "ratio": ratio,
                                               "ratio_all_cores": before}, indent=2))


if __name__ == "__main__":
    main()
