"""How long `zerograph status` and `zerograph report` take to answer, against `zerograph --help`.

    python bench/cli_startup.py [--preset tiny] [--repeats 3] [--outputs DIR]

Each command runs in a fresh interpreter (as a user types it), ``--repeats`` times; the best wall
time of each is printed in seconds, with its ratio to ``--help`` and the heavy libraries
(torch, transformers) the command left imported. The outputs folder is an empty temporary one
unless ``--outputs`` names one: `status` then lists every task as missing and `report` finds no
report, which is the work the commands do before they read anything (build the graph, hash each
task's settings). The target is under 2 s for `status` and `report` on an idle machine.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# run the CLI as `zerograph` does, then name the heavy libraries left in sys.modules
CHILD = ("import sys\nfrom workflows.cli import main\nsys.argv = ['zerograph', *sys.argv[1:]]\n"
         "try:\n    main()\nexcept SystemExit:\n    pass\n"
         "print('HEAVY', ','.join(m for m in ('torch', 'transformers') if m in sys.modules) or '-', file=sys.stderr)")


def best_of(args: list[str], repeats: int) -> tuple[float, str]:
    """The least wall time (s) of ``repeats`` runs of ``zerograph args`` and the heavy modules it imported."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    best, heavy = float("inf"), "?"
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300)
        best = min(best, time.perf_counter() - t0)
        heavy = next((ln.split()[1] for ln in r.stderr.splitlines() if ln.startswith("HEAVY ")), "?")
    return best, heavy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--outputs", default="")
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {a.repeats}")
    with tempfile.TemporaryDirectory() as tmp:
        outputs = a.outputs or tmp
        help_s, _ = best_of(["--help"], a.repeats)
        print(f"{'zerograph --help':<36} {help_s:6.2f} s")
        for cmd in ("status", "report"):
            s, heavy = best_of([cmd, "--preset", a.preset, "--outputs", outputs], a.repeats)
            print(f"{f'zerograph {cmd} --preset {a.preset}':<36} {s:6.2f} s  {s / help_s:5.1f}x --help  "
                  f"imports: {heavy}  (target < 2 s idle)")


if __name__ == "__main__":
    main()
