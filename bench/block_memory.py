"""Peak resident memory of a real ``TrainBlock`` task as the teacher deepens.

Two randomly initialised Llama teachers built from a config (no download), hidden 1024, 16 and
64 layers, differ only in depth. Each experiment has the same first block (teacher layers 0-3,
3 kept, boundaries ``[0, 4, L]``), so the block's size is fixed. For each teacher the cache is
built first (a Luigi run of ``TeacherBoundary``); then the ``TrainBlock`` of block 0 runs alone
in a fresh process (``luigi.build`` with the local scheduler, all its inputs done), which prints
its peak RSS (``VmHWM`` of ``/proc/self/status``; not ``ru_maxrss``, which Linux carries over
``execve`` from the forked copy of this parent, which held the teacher while building the cache). A block worker that loaded the whole teacher would grow with it
by the teacher's fp32 weight bytes, printed beside.

    python bench/block_memory.py [--layers 16 64] [--hidden 1024] [--workdir DIR] [--keep]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def experiment(teacher: Path, n_layers: int) -> str:
    """Override string of the benchmark's experiment on ``teacher``."""
    return (f"teacher={teacher} corpus.seq_len=32 corpus.max_tokens=640 boundary.boundaries=[0,4,{n_layers}] "
            "train.max_steps=4 train.batch_size=4 eval.context_window=8 boundary.batch_size=4 boundary.shard_sequences=16")


def child(spec: str) -> None:
    """Run block 0's TrainBlock alone; print its process's peak RSS (kB) as JSON."""
    import luigi

    from bench.common import find_task, proc_status_kb

    s = json.loads(spec)
    task = find_task(s["cfg"], s["outputs"], "TrainBlock", 0)
    t0 = time.perf_counter()
    ok = luigi.build([task], local_scheduler=True, log_level="WARNING")
    print(json.dumps({"ok": bool(ok), "seconds": time.perf_counter() - t0,
                      "maxrss_kb": proc_status_kb("VmHWM")}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs=2, default=[16, 64])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep", action="store_true")
    a = p.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    import luigi

    from bench.common import find_task, log, random_teacher

    work = Path(a.workdir or tempfile.mkdtemp(prefix="zg-blockmem-"))
    rows = []
    try:
        for L in a.layers:
            teacher = work / f"teacher-{L}"
            log(f"teacher of {L} layers, hidden {a.hidden}: writing random weights")
            sizes = random_teacher(teacher, L, a.hidden, 2 * a.hidden)
            cfg, outputs = experiment(teacher, L), work / f"out-{L}"
            log("building its cache (TeacherBoundary)")
            assert luigi.build([find_task(cfg, outputs, "TeacherBoundary")], local_scheduler=True, log_level="WARNING")
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            r = subprocess.run([sys.executable, __file__, "--child", json.dumps({"cfg": cfg, "outputs": str(outputs)})],
                               cwd=REPO, env=env, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"TrainBlock child failed:\n{r.stderr[-3000:]}")
            m = json.loads(r.stdout.strip().splitlines()[-1])
            if not m["ok"]:
                raise SystemExit(f"TrainBlock failed:\n{r.stderr[-3000:]}")
            rows.append({"layers": L, **sizes, **m})
            log(f"{L} layers: TrainBlock peak RSS {m['maxrss_kb'] / 1024:.0f} MiB; teacher fp32 {sizes['fp32_bytes'] / 2**20:.0f} MiB")
            shutil.rmtree(teacher)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    a16, a64 = rows
    print(f"\nPeak RSS of TrainBlock(0) (teacher layers 0-3, 3 kept; hidden {a.hidden}), fresh process each:")
    print(f"{'teacher layers':>15}{'teacher fp32 MiB':>18}{'TrainBlock peak RSS MiB':>26}{'task s':>9}")
    for r in rows:
        print(f"{r['layers']:>15}{r['fp32_bytes'] / 2**20:>18.0f}{r['maxrss_kb'] / 1024:>26.0f}{r['seconds']:>9.1f}")
    ratio = a64["maxrss_kb"] / a16["maxrss_kb"]
    print(f"peak RSS {a64['layers']} / {a16['layers']} layers: {ratio:.3f} (target: within 10%, i.e. < 1.10); "
          f"the teacher grew by {(a64['fp32_bytes'] - a16['fp32_bytes']) / 2**20:.0f} MiB of fp32 weights")
    return 0


if __name__ == "__main__":
    from bench.common import run_script

    run_script(main, "--child", child)
