"""The boundary store's input pipeline, as ratios measured in one run on this machine.

    python bench/data_feed.py            # hidden 576 (SmolLM2), 256 x 256-token sequences per boundary, ~5 min
    python bench/data_feed.py --quick    # the same shapes, 48 sequences, fewer repeats (under a minute)

A randomly initialised one-layer Llama of the store's hidden size (no download) writes a store of
boundaries 0 and 1 per storage dtype (float32, bfloat16, float16; format 4: contiguous, an xxh3_64
per sequence) in a temporary folder, and a copy of each rewritten as format 3 wrote it (one chunk
per sequence, Fletcher32: the layout before store format 4); everything is then read
from the page cache.

(a) ``read/raw <dtype> <ratio>``: the bytes :meth:`BoundaryReader.batches` delivers per second
    (both boundaries, a shuffled order, batch sizes 8, 16 and 32; stored bytes, checked and
    delivered in the storage dtype, as the reader returns them: the consumer widens 16-bit
    boundaries on its device) over the bytes per second of reading the same shard files whole with
    ``open().read()``; best of ``--repeats`` runs each, interleaved. The line gives the smallest
    ratio over the batch sizes (target >= 0.8). The same figure for the format-3 copies is printed
    above, as ``format 3 read/raw <dtype> <ratio>`` (before and after, in one run). Beside it,
    ``read/copy <dtype> <ratio>`` takes as the raw side ``readinto`` a reused buffer: the page
    cache's copy speed with no allocation. ``read()`` allocates a fresh buffer per file and is
    bimodal: ~2 GB/s when glibc maps it fresh (a page fault per 4 KiB), ~6 GB/s when a free heap
    chunk is reused, and which one a run gets depends on the process's heap history.
(b) ``wait <step_ms> sync <fraction> prefetch <fraction>``: a consumer that spends a fixed time
    per batch (``time.sleep``, releasing the GIL as a thread waiting on an accelerator does)
    iterates the float32 store's batches (batch size 8) read synchronously and through
    :func:`zgcore.data.feed.prefetch` (a worker process, ``train.prefetch`` default ahead): the share
    of wall time from the first batch on that the consumer spends blocked on its next batch
    (target < 0.05 with prefetching wherever the reader alone is faster than the step; the
    reader alone's time per batch is printed). The wait for the first batch (a worker's start,
    paid once per TrainBlock) is printed apart.
(c) ``identity``: a student block trained on the float32 store with ``train.prefetch`` 0 and 3
    ends with bitwise identical weights.
(d) ``train-loop slowdown``: a training-like loop on one thread (``--ops`` small torch ops per step
    on a 64 x 64 tensor, ``torch.set_num_threads(1)``: what a thread launching GPU kernels does)
    that takes one batch per step, fed either from batches already in memory or by
    :func:`zgcore.data.feed.block_batches` with two reader threads reading and checking ahead (a
    synthetic store of ``--slowdown-hidden`` 2048 bfloat16, 256 tokens: 1 MiB per sequence, 16 MiB
    per batch of both boundaries, :mod:`bench.store_scale`), and with two worker processes for
    comparison: interleaved rounds (``--repeats``, at least 3), the line gives the median over rounds of time with readers / the same round's time without
    - 1 (target < 0.05). On a machine with fewer free cores than threads, CPU contention is in
    the figure as well as the GIL: the load average is printed beside it. ``--pin`` runs the
    training thread on core 0 and the reader threads (and worker processes) on core 1, which
    removes that contention and leaves what a machine with cores to spare sees: the GIL
    hand-overs, memory bandwidth, caches. Timing starts after each arm's first batch.
    ``--slowdown-only`` runs just this part.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import as_format_3  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")
BATCH_SIZES = (8, 16, 32)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (under a minute)")
    p.add_argument("--sequences", type=int, default=None, help="training sequences in the store (default 256; 48 quick)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 256)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 576, SmolLM2's)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats of each read (best kept; default 5; 3 quick)")
    p.add_argument("--steps-ms", type=float, nargs="+", default=[2.0, 20.0, 50.0], help="simulated step times (ms)")
    p.add_argument("--batches", type=int, default=None, help="batches per simulated run (default 200; 40 quick)")
    p.add_argument("--workers", type=int, default=1, help="prefetching workers (train.prefetch_workers)")
    p.add_argument("--prefetch", type=int, default=None, help="batches ahead (default: train.prefetch's default)")
    p.add_argument("--pin", action="store_true", help="(d) with the training thread on core 0 and the reader threads on "
                   "core 1: no CPU contention between them, what a machine with cores to spare sees (2+ cores, Linux)")
    p.add_argument("--slowdown-only", action="store_true", help="only (d), the training-loop slowdown beside reader threads")
    p.add_argument("--slowdown-hidden", type=int, default=2048, help="hidden size of (d)'s store (bfloat16)")
    p.add_argument("--ops", type=int, default=300, help="small torch ops per training-like step in (d)")
    p.add_argument("--steps", type=int, default=None, help="steps of (d) (default 120; 40 quick)")
    a = p.parse_args(argv)
    a.sequences = a.sequences or (48 if a.quick else 256)
    a.seq_len = a.seq_len or 256
    a.hidden = a.hidden or 576
    a.repeats = a.repeats or (3 if a.quick else 5)
    a.batches = a.batches or (40 if a.quick else 200)
    a.steps = a.steps or (40 if a.quick else 120)
    return a


def build(root: Path, a) -> dict:
    """One store per storage dtype from a random one-layer teacher; returns ``{dtype: path}`` and the teacher."""
    from bench.common import random_teacher
    from zgcore.data.boundary_store import build_store
    from zgcore.models.teacher import load

    random_teacher(root / "teacher", 1, a.hidden, 2 * a.hidden, heads=max(1, a.hidden // 64), kv_heads=1)
    model, _ = load({"path": str(root / "teacher")})
    rng = np.random.default_rng(0)
    tokens = {"train": rng.integers(0, 256, (a.sequences, a.seq_len)).astype(np.int32),
              "val": rng.integers(0, 256, (8, a.seq_len)).astype(np.int32)}
    stores = {}
    for dtype in DTYPES:
        stores[dtype] = root / dtype
        build_store(stores[dtype], model, tokens, [0, 1], dtype, 8, {}, shard_sequences=-(-a.sequences // 8) * 8,
                    log=lambda m: None)
    return stores, model


def shard_files(reader, bs=(0, 1)) -> list[Path]:
    return [reader._shard_dir(sh) / sh["files"][f"b{b}"]["name"] for sh in reader.shards["train"] for b in bs]


def raw_read(files: list[Path]) -> float:
    """Seconds to read ``files`` whole (page cache)."""
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb") as fh:
            fh.read()
    return time.perf_counter() - t0


def raw_readinto(files: list[Path], buf: bytearray) -> float:
    """Seconds to read ``files`` into one reused buffer (a pure copy from the page cache)."""
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            fh.readinto(memoryview(buf)[: f.stat().st_size])
    return time.perf_counter() - t0


def store_read(reader, order: np.ndarray, batch_size: int) -> float:
    """Seconds to iterate every batch of boundaries 0 and 1 in ``order``."""
    t0 = time.perf_counter()
    for _ in reader.batches("train", 0, 1, order, batch_size):
        pass
    return time.perf_counter() - t0


def read_ratios(stores: dict, a) -> dict:
    """Per dtype and batch size: store bytes/s over raw bytes/s (best of ``a.repeats``, interleaved)."""
    from zgcore.data.boundary_store import BoundaryReader

    out = {}
    order = np.random.default_rng(1).permutation(a.sequences)
    for dtype, path in stores.items():
        with BoundaryReader(path) as r:
            fmt = f"format {r.version}"
            files = shard_files(r)
            file_bytes = sum(f.stat().st_size for f in files)
            data_bytes = 2 * a.sequences * a.seq_len * a.hidden * (4 if dtype == "float32" else 2)
            buf = bytearray(max(f.stat().st_size for f in files))
            raw_read(files), store_read(r, order, 8)  # warm the page cache and the open files
            for bs in BATCH_SIZES:
                raw_s, into_s, store_s = [], [], []
                for _ in range(a.repeats):
                    raw_s.append(raw_read(files))
                    into_s.append(raw_readinto(files, buf))
                    store_s.append(store_read(r, order, bs))
                raw_gbs, store_gbs = file_bytes / min(raw_s) / 1e9, data_bytes / min(store_s) / 1e9
                into_gbs = file_bytes / min(into_s) / 1e9
                out[(dtype, bs)] = (store_gbs / raw_gbs, store_gbs, raw_gbs, into_gbs)
                print(f"  {fmt} {dtype:8s} batch {bs:2d}: store {store_gbs:.2f} GB/s of stored bytes; raw read() "
                      f"{raw_gbs:.2f}, readinto a reused buffer {into_gbs:.2f} GB/s of file bytes "
                      f"(file/data {file_bytes / data_bytes:.3f})", flush=True)
    return out


def _all_batches(path: str, order: np.ndarray, batch_size: int, passes: int, worker: int = 0, workers: int = 1):
    """Batches ``worker, worker + workers, ...`` of boundaries 0 and 1 in ``order``, repeated
    ``passes`` times, from a reader of its own (what a worker process runs)."""
    from zgcore.data.boundary_store import BoundaryReader

    batches = [order[k: k + batch_size] for k in range(0, len(order), batch_size)] * passes
    with BoundaryReader(path) as r:
        for idx in batches[worker::workers]:
            yield r.read("train", 0, idx), r.read("train", 1, idx)


def wait_fractions(path: Path, a, ahead: int, mode: str) -> dict:
    """Per step time: the share of wall time a sleeping consumer waits for data, sync and prefetching
    with worker ``mode`` (``"thread"`` or ``"process"``, ``train.prefetch_mode``)."""
    from zgcore.data.boundary_store import BoundaryReader
    from zgcore.data.feed import prefetch

    order = np.random.default_rng(2).permutation(a.sequences)
    bs, out = 8, {}
    per_pass = (a.sequences + bs - 1) // bs
    passes = max(1, -(-a.batches // per_pass))  # the worker starts once per TrainBlock: amortise it as a run does
    with BoundaryReader(path) as r:
        alone = min(store_read(r, order, bs) for _ in range(a.repeats)) / per_pass
        print(f"  the reader alone: {1e3 * alone:.2f} ms per batch of {bs}; prefetching with {mode} workers", flush=True)
        for step_ms in a.steps_ms:
            res, starts = {}, {}
            for arm, k in (("sync", 0), ("prefetch", ahead)):
                best = None
                for _ in range(2):
                    t0 = time.perf_counter()
                    it = prefetch(partial(_all_batches, str(path), order, bs, passes), k, workers=a.workers, mode=mode)
                    next(it)  # the first batch (the worker's start): paid once per TrainBlock, printed apart
                    t1, waited = time.perf_counter(), 0.0
                    while True:
                        time.sleep(step_ms / 1e3)  # the step
                        t = time.perf_counter()
                        if next(it, None) is None:
                            break
                        waited += time.perf_counter() - t  # blocked on the next batch
                    frac = waited / (time.perf_counter() - t1)
                    starts[arm] = min(starts.get(arm, t1 - t0), t1 - t0)
                    best = frac if best is None else min(best, frac)
                res[arm] = best
            out[step_ms] = (res["sync"], res["prefetch"], alone)
            print(f"  step {step_ms:g} ms: first batch after {1e3 * starts['sync']:.0f} ms sync, "
                  f"{1e3 * starts['prefetch']:.0f} ms prefetching (the worker's start)", flush=True)
    return out


def identity(path: Path, model, a) -> bool:
    """A block trained with prefetch 0 and 3 on the float32 store: bitwise identical weights?"""
    from bench.common import train_settings
    from zgcore.models.adapters import build_block
    from zgcore.data.boundary_store import BoundaryReader
    from zgcore.training.blocks import BlockTraining, train_block

    weights = []
    for ahead in (0, 3):
        block = build_block(model, [0], "teacher", 7)
        t = train_settings(4, max_steps=6 if a.quick else 20, prefetch=ahead, objective="noisy")
        with BoundaryReader(path) as r, tempfile.TemporaryDirectory() as work:
            train_block(block, r, 0, 1, BlockTraining(t, 7, Path(work), f"p{ahead}"))
        weights.append(block.layer_state_dict())
    return weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def _started(batches, pin: bool):
    """``batches`` as an iterator whose first item has been taken (so that reader threads have
    started); with ``pin`` the threads it starts run on core 1 (they inherit the affinity of the
    thread that starts them) and the calling (training) thread on core 0 afterwards."""
    import os

    it = iter(batches)
    if pin:
        os.sched_setaffinity(0, {1})  # 0: the calling thread
    next(it)
    if pin:
        os.sched_setaffinity(0, {0})
    return it


def _ops(x: torch.Tensor, n_ops: int) -> torch.Tensor:
    for _ in range(n_ops):
        x = torch.tanh(x * 0.5 + 0.1)
    return x


def _windows(batches, n_ops: int, windows: int, width: int = 3) -> tuple[list[float], list[float]]:
    """Seconds of ``windows`` pairs of windows of ``width`` training-like steps (``n_ops`` small
    torch ops each), alternating: a window whose first step takes a batch from ``batches`` (so the
    workers read and check one batch during it), then a window that takes none (the workers are
    idle: their queue is full). Returns (with a batch, without), in order: paired minutes apart by
    milliseconds, so that this machine's drifts hit both alike."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    took, idle = [], []
    for _ in range(windows):
        t0 = time.perf_counter()
        next(batches)
        for _ in range(width):
            x = _ops(x, n_ops)
        t1 = time.perf_counter()
        for _ in range(width):
            x = _ops(x, n_ops)
        took.append(t1 - t0)
        idle.append(time.perf_counter() - t1)
    return took, idle


def step_slowdown(root: Path, a, ahead: int) -> dict:
    """(d): what reading and checking one batch ahead costs the training thread, with two worker
    threads and with two worker processes. Each arm alternates windows of 3 training-like steps
    that take a batch (the workers then read the next one) with windows that take none (the
    workers wait), ``a.steps`` pairs; the cost of one batch is the median over pairs of (window
    with - window without), and the slowdown of a step that takes one batch is that cost / the
    median step without. Pairs a few milliseconds apart cancel this machine's drifts, which made
    whole-run comparisons swing by ±30% here. Returns ``{arm: slowdown}`` and prints each arm's
    cost per batch with its interquartile range."""
    from bench.store_scale import write_store
    from zgcore.data.boundary_store import BoundaryReader
    from zgcore.data.feed import block_batches

    n_seq = max(64, a.steps * 8 // 2)  # each sequence read about twice over the run: warm page cache
    join = write_store(root / "slowdown", n_seq * 256 * a.slowdown_hidden * 2 / 1e9, a.slowdown_hidden, 256)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        with BoundaryReader(join) as r:
            n = r.n("train")
            t0 = time.perf_counter()
            for _ in block_batches(r, 0, 1, n, 0, 8, 0, 8, 0):
                pass
            read_s = (time.perf_counter() - t0) / 8
            for mode in ("thread", "process"):
                for _ in range(max(1, a.repeats // 3)):
                    it = _started(block_batches(r, 0, 1, n, 0, 8, 0, a.steps + 2, ahead, workers=2, mode=mode), a.pin)
                    time.sleep(0.5)  # the workers fill their queues
                    took, idle = _windows(it, a.ops, a.steps)
                    it.close()
                    cost = np.array(took) - np.array(idle)
                    step = float(np.median(idle)) / 3
                    q1, med, q3 = np.percentile(cost, [25, 50, 75])
                    out.setdefault(mode, []).append(med / step)
                    print(f"  (d) {mode} workers: one batch costs the training thread {1e3 * med:.2f} ms (IQR {1e3 * q1:.2f} .. "
                          f"{1e3 * q3:.2f}) against a {1e3 * step:.2f} ms step: slowdown {med / step:.3f}", flush=True)
    finally:
        torch.set_num_threads(threads)
        if a.pin:
            import os

            os.sched_setaffinity(0, set(range(os.cpu_count())))
    print(f"  (d) {a.steps} window pairs of 3 steps of {a.ops} small ops; reading and checking one batch (16 MiB at "
          f"hidden {a.slowdown_hidden}) takes {1e3 * read_s:.1f} ms on one thread", flush=True)
    return {"threads": float(np.median(out["thread"])), "processes": float(np.median(out["process"]))}


def main(argv=None) -> int:
    import os

    from zgcore.config.defaults import DEFAULTS
    from zgcore.data.feed import resolve_feed

    a = parse(argv)
    if a.slowdown_only:
        ahead = a.prefetch if a.prefetch is not None else int(DEFAULTS["train"]["prefetch"])
        root = Path(tempfile.mkdtemp(prefix="data_feed-"))
        try:
            slow = step_slowdown(root, a, ahead)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        load = os.getloadavg()
        print(f"train-loop slowdown two reader threads {slow['threads']:.3f} two worker processes {slow['processes']:.3f} "
              f"(load average {load[0]:.1f} on {os.cpu_count()} cores)")
        return 0
    ahead = a.prefetch if a.prefetch is not None else int(DEFAULTS["train"]["prefetch"])
    torch.manual_seed(0)
    root = Path(tempfile.mkdtemp(prefix="data_feed-"))
    try:
        print(f"stores: {a.sequences} sequences x {a.seq_len} tokens x hidden {a.hidden}, boundaries 0 and 1, "
              f"{', '.join(DTYPES)}", flush=True)
        stores, model = build(root, a)
        old = {dtype: as_format_3(Path(shutil.copytree(path, root / f"{dtype}-format3"))) for dtype, path in stores.items()}
        before = read_ratios(old, a)
        ratios = read_ratios(stores, a)
        waits = {mode: wait_fractions(stores["float32"], a, ahead, mode) for mode in ("process", "thread")}
        same = identity(stores["float32"], model, a)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"identity weights prefetch 0 vs 3: {'bitwise identical' if same else 'DIFFERENT'}")
    for dtype in DTYPES:
        print(f"format 3 read/raw {dtype} {min(before[(dtype, bs)][0] for bs in BATCH_SIZES):.2f}")
    for dtype in DTYPES:
        print(f"read/copy {dtype} {min(v[1] / v[3] for (d, _), v in ratios.items() if d == dtype):.2f}  "
              f"(format 3: {min(v[1] / v[3] for (d, _), v in before.items() if d == dtype):.2f})")
    for dtype in DTYPES:
        print(f"read/raw {dtype} {min(ratios[(dtype, bs)][0] for bs in BATCH_SIZES):.2f}")
    for mode in ("process", "thread"):
        for step_ms, (sync, pre, _) in waits[mode].items():
            print(f"{mode} workers: wait {step_ms:g} sync {sync:.3f} prefetch {pre:.3f}")
    # the simulated step stands for an accelerator's: what train.prefetch_mode=auto (the default) picks for it
    mode, workers = resolve_feed(DEFAULTS["train"]["prefetch_mode"], DEFAULTS["train"]["prefetch_workers"],
                                 8 * 2 * a.seq_len * a.hidden * 4, accelerator=True)
    if workers == a.workers:
        for step_ms, (sync, pre, _) in waits[mode].items():
            print(f"wait {step_ms:g} sync {sync:.3f} prefetch {pre:.3f}   (the default: {workers} {mode} workers)")
    else:
        print(f"(the default for this simulated accelerator is {workers} {mode} workers: run with --workers {workers})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
