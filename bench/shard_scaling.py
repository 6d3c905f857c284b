"""Build scaling of the sharded teacher cache on luigid.

A randomly initialised Llama teacher built from a config (no download) and the default corpus
cut into 128-token sequences give a cache of 8 shards: 7 training shards of 192 sequences and one
validation shard (an even count of about equal shards, so two workers can split it evenly). The
corpus is tokenised first, so every worker sees the shards as static requirements. Then the
``TeacherBoundary`` task (its shards and the join) is built against one luigid by one worker
process, and again — from scratch, same outputs otherwise — by two worker processes started
together, each with ``OMP_NUM_THREADS=1``. Wall time is from starting the workers to the last
one exiting (process start-up included). Also measured, single-threaded in this process over the
same sequences: the cache build (``build_store``) ÷ the same teacher forwards with nothing
captured or written (figure 1's interleaved method).

    python bench/shard_scaling.py [--hidden 512] [--layers 8] [--shards 7] [--shard-sequences 192]
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


def experiment(teacher: Path, a) -> str:
    want = a.shards * a.shard_sequences  # train sequences = shards x shard_sequences exactly (10% held out)
    n = next(n for n in range(want, 2 * want + 10) if n - max(1, round(n * 0.1)) == want)
    return (f"teacher={teacher} corpus.seq_len={a.seq_len} corpus.max_tokens={n * a.seq_len} "
            f"boundary.num_blocks=2 boundary.shard_sequences={a.shard_sequences}")


def worker(spec: str) -> None:
    """One worker: build TeacherBoundary against luigid."""
    import luigi

    from bench.common import find_task

    s = json.loads(spec)
    task = find_task(s["cfg"], s["outputs"], "TeacherBoundary")
    luigi.build([task], scheduler_host="127.0.0.1", scheduler_port=s["port"], no_lock=True, log_level="WARNING")


def timed_build(n_workers: int, cfg: str, outputs: Path, port: int, logdir: Path) -> float:
    for fam in ("BoundaryShard", "TeacherBoundary"):
        shutil.rmtree(outputs / fam, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1"}
    spec = json.dumps({"cfg": cfg, "outputs": str(outputs), "port": port})
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", spec], cwd=REPO, env=env,
                              stdout=open(logdir / f"w{n_workers}-{i}.log", "w"), stderr=subprocess.STDOUT)
             for i in range(n_workers)]
    for p in procs:
        p.wait()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--shards", type=int, default=7)  # 7 training shards + 1 validation shard = 8
    p.add_argument("--shard-sequences", type=int, default=192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--workdir", default=None)
    a = p.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    import luigi
    import torch

    from bench import cache_build
    from bench.common import find_task, log, random_teacher
    from tests.luigid_util import free_port, start_luigid
    from zgcore.data import corpus
    from zgcore.models.shapes import resolve_boundaries
    from zgcore.models.teacher_weights import load_base

    work = Path(a.workdir or tempfile.mkdtemp(prefix="zg-shardscale-"))
    ok = False
    try:
        teacher = work / "teacher"
        random_teacher(teacher, a.layers, a.hidden, 3 * a.hidden, heads=8, kv_heads=4)
        cfg, outputs = experiment(teacher, a), work / "out"
        assert luigi.build([find_task(cfg, outputs, "PrepareCorpus")], local_scheduler=True, log_level="WARNING")
        tb = find_task(cfg, outputs, "TeacherBoundary")
        log(f"{len(tb.shard_tasks())} shards of {a.shard_sequences} x {a.seq_len} tokens; teacher {a.layers} layers, "
            f"hidden {a.hidden}; load average {os.getloadavg()}")
        wall = {}
        for n in (1, 2):  # a fresh luigid for each, so that neither remembers the other's tasks
            port = free_port()
            (work / f"luigid-{n}").mkdir()
            luigid = start_luigid(work / f"luigid-{n}", port)
            try:
                wall[n] = timed_build(n, cfg, outputs, port, work)
            finally:
                luigid.terminate()
                luigid.wait(timeout=20)
            if not (tb.out_dir / "manifest.json").is_file():
                raise SystemExit(f"the {n}-worker build did not finish; logs in {work}")
        man = json.loads((tb.out_dir / "manifest.json").read_text())
        log(f"load average after the luigid runs {os.getloadavg()}")
        torch.set_num_threads(1)
        rec = json.loads((find_task(cfg, outputs, "PrepareTeacher").out_dir / "teacher.json").read_text())
        bs = resolve_boundaries(tb.boundary, a.layers)
        tok = tb.requires()["corpus"].out_dir / "tokens.h5"
        tokens = {s: corpus.read_tokens(tok, s) for s in ("train", "val")}
        f1 = cache_build.measure(load_base(rec, max(bs)), tokens, bs, "float32", 8, work / "store-f1")
        ok = True
    finally:
        if ok:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nCache of {man['n_shards']} shards ({man['n_train']} + {man['n_val']} sequences of {a.seq_len} tokens, "
          f"teacher {a.layers} layers, hidden {a.hidden}), OMP_NUM_THREADS=1 per worker, one luigid:")
    print(f"  one worker : {wall[1]:7.1f} s wall")
    print(f"  two workers: {wall[2]:7.1f} s wall   (last run's shards: {man['build_seconds']:.1f} s teacher time summed, "
          f"{man['build_wall_seconds']:.1f} s from first shard start to last shard end)")
    print(f"  speed-up   : {wall[1] / wall[2]:.2f}x (target >= 1.7x on 2 cores)")
    print(f"  cache build / teacher forward-only, 1 thread: {f1['build_s']:.1f} s / {f1['forward_s']:.1f} s = "
          f"{f1['ratio']:.3f} (target <= 1.05)")
    print(f"  load average (1, 5, 15 min) at the end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    from bench.common import run_script

    run_script(main, "--worker", worker)
