"""Steady read rate through the prefetch path before and after a change, in one run: the code of an
older checkout (``--old``: e.g. ``git worktree add /tmp/old 85a8f70``, store format 4, thread
workers) reading the store as format 4, and this tree with thread and with process workers, each
over a direct ``os.preadv`` of the same batches without checks; 3 interleaved rounds, each the best
of 3 passes of ``--batches`` batches (8 random sequences of both boundaries, hidden 2048 bfloat16),
timed from batch ``--warm`` on: start-up (workers started, files opened) and the first touch of
each batch buffer's pages (paid once per run, in a run of thousands of steps) excluded.

    .venv/bin/python bench/steady_before_after.py --old /tmp/old --gb 0.94
"""
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
import argparse
_p = argparse.ArgumentParser(description="steady prefetch rate, an older checkout against this tree")
_p.add_argument("--old", required=True, help="an older checkout of this repository (its zgcore is imported)")
_p.add_argument("--gb", type=float, default=0.94, help="GB per boundary file (default 0.94)")
_p.add_argument("--batches", type=int, default=112, help="batches per pass (default 112; at most a pass over the store)")
_p.add_argument("--warm", type=int, default=16, help="batches before the clock starts (default 16)")
ARGS = _p.parse_args()
NEW, OLD = str(Path(__file__).resolve().parents[1]), ARGS.old
sys.path.insert(0, NEW)
from bench.store_scale import write_store, as_format_4  # noqa: E402 (after the path insert above)

root = Path(tempfile.mkdtemp(prefix="steady-"))
join = write_store(root / "s", ARGS.gb, 2048, 256)
old = as_format_4(join)
code = r'''
import os, sys, time, numpy as np
sys.path.insert(0, REPO)
from zgcore.data.boundary_store import BoundaryReader
from zgcore.data.feed import block_batches
from zgcore.data.order import data_order
join, mode, batches, warm = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with BoundaryReader(join) as r:
    n = r.n("train"); sh = r.shards["train"][0]
    files = [r._shard_dir(sh) / sh["files"][f"b{b}"]["name"] for b in (0, 1)]
    offs = [sh["files"][f"b{b}"].get("data", [None])[0] for b in (0, 1)]
    seq = int(r.manifest["seq_len"]) * int(r.manifest["hidden_size"]) * 2
    order = data_order(n, 0, 0)[: batches * 8]
    nbytes = 2 * batches * 8 * seq
    def pre():
        kw = {} if mode == "old" else {"mode": mode}
        it = iter(block_batches(r, 0, 1, n, 0, 8, 0, batches, 2, workers=2, **kw))
        for _ in range(warm):  # start-up and first-touch of the batch buffers excluded: the steady rate
            next(it)
        t0 = time.perf_counter()
        for _ in it:
            pass
        return time.perf_counter() - t0
    pre()
    print(nbytes * (batches - warm) / batches / min(pre() for _ in range(3)) / 1e9)
'''
def run(repo, join, mode):
    out = subprocess.run([sys.executable, "-c", code.replace("REPO", repr(repo)), str(join), mode, str(ARGS.batches), str(ARGS.warm)], capture_output=True, text=True)
    if out.returncode:
        print(out.stderr[-2000:])
        raise SystemExit(1)
    return float(out.stdout.split()[-1])
def direct(join):
    sys.path.insert(0, NEW)
    from zgcore.data.boundary_store import BoundaryReader
    from zgcore.data.order import data_order
    with BoundaryReader(join) as r:
        n, sh = r.n("train"), r.shards["train"][0]
        files = [r._shard_dir(sh) / sh["files"][f"b{b}"]["name"] for b in (0, 1)]
        offs = [sh["files"][f"b{b}"]["data"][0] for b in (0, 1)]
        seq = int(r.manifest["seq_len"]) * int(r.manifest["hidden_size"]) * 2
        order = data_order(n, 0, 0)[ARGS.warm * 8: ARGS.batches * 8]
        buf, fds = bytearray(8 * seq), [os.open(f, os.O_RDONLY) for f in files]
        def once():
            t0 = time.perf_counter()
            for k in range(0, len(order), 8):
                for fd, off in zip(fds, offs):
                    for i, s in enumerate(order[k:k + 8]):
                        os.preadv(fd, [memoryview(buf)[i * seq:(i + 1) * seq]], off + int(s) * seq)
            return time.perf_counter() - t0
        once()
        return 2 * len(order) * seq / min(once() for _ in range(3)) / 1e9
res = {"old": [], "thread": [], "process": [], "direct": []}
for _ in range(3):
    res["direct"].append(direct(join))
    res["old"].append(run(OLD, old, "old"))
    res["thread"].append(run(NEW, join, "thread"))
    res["process"].append(run(NEW, join, "process"))
import statistics as st  # noqa: E402
d = st.median(res["direct"])
for k, v in res.items():
    print(f"{k:8s} GB/s {' '.join(f'{x:.2f}' for x in v)}  median {st.median(v):.2f}  / direct {st.median(v) / d:.2f}")
print(f"load average {os.getloadavg()[0]:.1f}")
