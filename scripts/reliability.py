"""The fault campaign of docs/reliability.md ("Full disks and shared folders"): a full disk at a random
point of every task family's write, then the same command after space is freed; and 2 and 3 runs at
once sharing tasks on one outputs folder.

    sudo .venv/bin/python -m scripts.reliability                      # every registered workflow's tiny preset
    sudo .venv/bin/python -m scripts.reliability --workflow RunExperiment --seed 1 --json out.json

For each registered workflow (:mod:`workflows.registry`) the tiny preset is first run on a plain
folder (the reference). Then, for every task family of its graph, one trial: a fresh tmpfs (the
script mounts it; root only) gets a copy of the reference outputs without that family's outputs and
everything downstream of them, and a filler file that leaves free a random fraction (seeded; whole
pages, at least one) of the bytes that family's outputs hold; the workflow's ``luigi`` command then
runs there, so the disk fills
in the middle of that family's write. A trial passes when that run exits non-zero (not a signal)
with exactly one ``error:`` line, naming "no space" or "quota", and no traceback; and when, after the
filler is removed, the same command exits 0 and its outputs equal the reference's: every weight file
and report number (:func:`scripts.golden.digests`; of the reports' numbers, only the step a block resumed
from, ``resumed_from``, may differ), every HDF5 store and ``.npy`` file byte for byte.

The concurrent trials start 2 and then 3 ``luigi`` commands at once on one fresh folder (two workflows
sharing the teacher; identical commands; two experiments that differ only in ``eval.context_window``)
and pass when every one exits 0 and the shared tasks' outputs equal the reference's.
Prints one line per trial and a summary; exits 1 when a trial failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LUIGI = [str(REPO / ".venv" / "bin" / "luigi"), "--module", "workflows"]


def command(workflow: str, preset: str, outputs: Path, *extra: str) -> list[str]:
    """The ``luigi`` command line of ``workflow`` on ``preset`` under ``outputs``."""
    return [*LUIGI, workflow, "--local-scheduler", "--preset", preset, "--outputs", str(outputs), *extra]


def run(cmd: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repository root with this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def graph(workflow: str, preset: str, outputs: Path) -> list:
    """Every task of the workflow's graph under ``outputs`` (as ``zerograph status`` lists them)."""
    from workflows.cli import all_tasks, root_tasks

    return all_tasks(root_tasks("", [], preset, str(outputs), workflow))


def fingerprints(workflow: str, preset: str, outputs: Path) -> dict[str, str]:
    """What must equal between two runs: :func:`scripts.golden.digests` of the graph's outputs, plus the
    SHA-256 of every ``.h5`` and ``.npy`` file in them, keyed by task title and file."""
    from scripts.golden import _folders, _numbers, digests

    tasks = graph(workflow, preset, outputs)
    out = dict(digests(tasks))
    for title, folder in _folders(tasks):
        for f in sorted(folder.rglob("report.json")):  # where a block resumed from is recorded: not a result
            nums = {k: v for k, v in _numbers(json.loads(f.read_text())).items() if "resumed" not in k}
            out[f"{title}/{f.relative_to(folder)}"] = hashlib.sha256(
                json.dumps(nums, sort_keys=True).encode()
            ).hexdigest()
        for f in sorted([*folder.rglob("*.h5"), *folder.rglob("*.npy")]):
            out[f"{title}/{f.relative_to(folder)}"] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


PAGE = 4096  # a tmpfs allocates whole pages


def _size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else 0


def _pages(p: Path) -> int:
    """The pages the files under ``p`` take on a tmpfs."""
    return sum(-(-f.stat().st_size // PAGE) for f in p.rglob("*") if f.is_file()) if p.is_dir() else 0


def downstream(tasks: list, family: str) -> list:
    """The tasks of ``family`` and every task that reads one of them, transitively."""
    hit = {t.task_id for t in tasks if t.get_task_family() == family}
    changed = True
    while changed:
        changed = False
        for t in tasks:
            if t.task_id not in hit and any(u.task_id in hit for u in t.read_upstream()):
                hit.add(t.task_id)
                changed = True
    return [t for t in tasks if t.task_id in hit]


class Tmpfs:
    """A tmpfs of ``size`` bytes mounted on a fresh temporary folder for the ``with`` block (root only)."""

    def __init__(self, size: int):
        self.size, self.path = size, Path(tempfile.mkdtemp(prefix="zg-full-"))

    def __enter__(self) -> Path:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.path)], check=True)
        return self.path

    def __exit__(self, *exc) -> None:
        subprocess.run(["umount", str(self.path)], check=False)
        shutil.rmtree(self.path, ignore_errors=True)


def one_line_outcome(r: subprocess.CompletedProcess) -> str | None:
    """``None`` when a failed run ended as a full disk should: a non-zero exit that is no signal, one
    ``error:`` line naming no space or quota, no traceback, no segfault; else what was wrong."""
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    if r.returncode == 0:
        return "exit 0 on a full disk"
    if r.returncode < 0 or r.returncode > 128:
        return f"exit {r.returncode} (a signal)"
    if "Traceback" in r.stderr or "Traceback" in r.stdout:
        return "a traceback: " + r.stderr.strip().splitlines()[-1][:200]
    if len(errors) != 1 or not any(w in errors[0].lower() for w in ("no space", "quota")):
        return f"{len(errors)} error line(s): {errors[:2]}"
    return None


def fill_trial(workflow: str, preset: str, family: str, ref: Path, ref_prints: dict, rng: random.Random) -> dict:
    """One full-disk trial of ``family`` (see the module docstring); returns its record."""
    tasks = graph(workflow, preset, ref)
    gone = downstream(tasks, family)
    need = sum(_size(t.out_dir) for t in gone if t.get_task_family() == family)
    pages = sum(_pages(t.out_dir) for t in gone if t.get_task_family() == family)
    frac = rng.uniform(0.05, 0.95)
    # at least one page (the up-front probe of the outputs folder passes: the family's own write fills the disk),
    # at most all but one of the pages its outputs take
    leave = PAGE * min(max(1, int(frac * pages)), max(1, pages - 1))
    rec = {"workflow": workflow, "family": family, "bytes": need, "free_fraction": round(frac, 3), "free_bytes": leave}
    with Tmpfs(_size(ref) + (64 << 20)) as fs:
        shutil.copytree(ref, fs, dirs_exist_ok=True, symlinks=True)
        for t in graph(workflow, preset, fs):
            if t.task_id in {g.task_id for g in gone}:
                shutil.rmtree(t.out_dir, ignore_errors=True)
        free = shutil.disk_usage(fs).free
        filler = fs / "filler"
        with open(filler, "wb") as f:
            left = max(0, free - leave)
            while left > 0:
                n = f.write(b"\0" * min(left, 1 << 22))
                left -= n
        cmd = command(workflow, preset, fs)
        t0 = time.time()
        r = run(cmd)
        rec["fail_exit"], rec["fail_s"] = r.returncode, round(time.time() - t0, 1)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        rec["line"] = errors[0][:300] if errors else (r.stderr.strip().splitlines() or [""])[-1][:300]
        problem = one_line_outcome(r)
        if problem and r.returncode == 0:
            problem = None  # the family's output fit in what was left: nothing to test, counted apart
            rec["fit"] = True
        filler.unlink()
        r2 = run(cmd)
        rec["rerun_exit"] = r2.returncode
        if r2.returncode != 0:
            problem = problem or f"rerun exit {r2.returncode}: {r2.stderr.strip()[-300:]}"
        else:
            diff = [k for k in ref_prints if fingerprints(workflow, preset, fs).get(k) != ref_prints[k]]
            if diff and os.environ.get("ZG_CAMPAIGN_KEEP"):  # keep both trees to compare
                shutil.copytree(fs, Path(os.environ["ZG_CAMPAIGN_KEEP"]) / f"{workflow}-{family}", dirs_exist_ok=True)
            if diff:
                problem = problem or f"rerun differs from the reference in {diff[:3]}"
    rec["problem"] = problem
    return rec


def concurrent_trial(name: str, cmds: list[tuple[str, str, list[str]]], refs: dict) -> dict:
    """Start every ``(workflow, preset, extra args)`` of ``cmds`` at once on one fresh folder; passes when
    all exit 0 and each workflow's fingerprints equal its reference's."""
    out = Path(tempfile.mkdtemp(prefix="zg-shared-"))
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen(
                command(w, p, out, *x), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for w, p, x in cmds
        ]
        results = [(p.wait(timeout=1800), p.stderr.read()) for p in procs]
        problem = next((f"exit {c}: {e.strip()[-300:]}" for c, e in results if c != 0), None)
        for w, p, x in cmds:
            if not problem and not x and (w, p) in refs:
                got = fingerprints(w, p, out)
                diff = [k for k, v in refs[(w, p)].items() if got.get(k) != v]
                problem = f"{w} differs from its reference in {diff[:3]}" if diff else None
        return {"trial": name, "runs": len(cmds), "exits": [c for c, _ in results], "problem": problem}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workflow", action="append", help="a registered workflow (repeatable; default: all)")
    ap.add_argument("--family", action="append", help="only these task families (repeatable)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the free fraction of each trial")
    ap.add_argument("--no-concurrent", action="store_true", help="skip the concurrent trials")
    ap.add_argument("--json", help="write every trial's record here")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("error: the campaign mounts small tmpfs folders: run it as root (sudo)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    from workflows import registry

    rng, records, refs = random.Random(a.seed), [], {}
    base = Path(tempfile.mkdtemp(prefix="zg-ref-"))
    try:
        for wf in [registry.get(w) for w in a.workflow] if a.workflow else registry.all_workflows():
            ref = base / wf.name
            r = run(command(wf.name, wf.tiny, ref))
            if r.returncode != 0:
                records.append({"workflow": wf.name, "family": "(reference run)", "problem": r.stderr[-300:]})
                continue
            refs[(wf.name, wf.tiny)] = fingerprints(wf.name, wf.tiny, ref)
            families = sorted({t.get_task_family() for t in graph(wf.name, wf.tiny, ref)})
            for fam in families:
                if a.family and fam not in a.family:
                    continue
                rec = fill_trial(wf.name, wf.tiny, fam, ref, refs[(wf.name, wf.tiny)], rng)
                records.append(rec)
                print(
                    f"{'FAIL' if rec['problem'] else 'ok  '} full disk  {wf.name:<18} {fam:<24} "
                    f"{rec.get('free_fraction', 0):.2f} of {rec.get('bytes', 0) / 2**20:.2f} MiB free: exit "
                    f"{rec.get('fail_exit')} then {rec.get('rerun_exit')}  "
                    f"{rec['problem'] or rec.get('line', '')[:140]}",
                    flush=True,
                )
        if not a.no_concurrent and ("RunExperiment", "tiny") in refs:
            ex = ("RunExperiment", "tiny", [])
            for name, cmds in [
                ("two workflows sharing the teacher", [ex, ("ObjectiveStudy", "study_tiny", [])]),
                ("two identical commands", [ex, ex]),
                (
                    "three runs: two identical, one other eval.context_window",
                    [ex, ex, ("RunExperiment", "tiny", ["--set", "eval.context_window=8"])],
                ),
            ]:
                rec = concurrent_trial(name, cmds, refs)
                records.append(rec)
                print(
                    f"{'FAIL' if rec['problem'] else 'ok  '} concurrent {rec['runs']} runs: {name}: exits "
                    f"{rec['exits']}  {rec['problem'] or ''}",
                    flush=True,
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    failed = [r for r in records if r.get("problem")]
    fills = [r for r in records if "free_fraction" in r]
    print(
        f"{len(records)} trial(s): {len(fills)} full-disk "
        f"({sum(1 for r in fills if r.get('fit'))} where the write fit), "
        f"{len(records) - len(fills)} concurrent or reference; {len(failed)} failed"
    )
    if a.json:
        Path(a.json).write_text(json.dumps(records, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
