"""Start-up and steady reading of a boundary store at a 7B-class width, as ratios measured in one run.

    python bench/store_scale.py            # hidden 2048 bfloat16, boundary files of ~0.5 GB and ~8 GB each (~17 GB of disk)
    python bench/store_scale.py --quick    # files of ~64 MB and ~1 GB each: under two minutes

Synthetic stores (no teacher: the bytes of 64 random bfloat16 sequences repeated, each sequence's
xxh3_64 recorded, written with the store's own layout and records, :func:`file_record` and
:func:`join_shards`), one shard of two boundary files per size, in a temporary folder under
``--dir`` (removed at the end; free disk is checked first). Per size:

* ``first-batch <GB per file> <seconds>``: from opening a :class:`BoundaryReader` to the first
  batch (8 random sequences of both boundaries, checked), median of ``--repeats``, warm page
  cache (the metadata read once before); the same with the files' records downgraded to format 4
  (the whole file hashed at open, as before format 5) once, as ``format-4 first-batch``; and
  through :func:`zgcore.data.feed.block_batches` with two thread workers (each opens its files)
  as ``first-batch-prefetch``. ``cold`` figures follow when the page cache can be dropped
  (``/proc/sys/vm/drop_caches``, root only).
* at the largest size, the steady rate through the prefetch path (two thread workers, the
  default ``train.prefetch`` ahead) over the same batches read directly with ``os.preadv`` and no
  checks: ``prefetch/direct <ratio>``.

The last line is ``first-batch ratio <largest ÷ smallest>`` (target <= 1.5: start-up does not
grow with the store).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

BATCH = 8


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="files of ~64 MB and ~1 GB (under two minutes)")
    p.add_argument("--gb", type=float, nargs="+", default=None, help="GB per boundary file, per size (default 0.5 8; quick 0.064 1)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (>= 2048: a 7B-class width)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--repeats", type=int, default=3, help="timed first batches per size (median kept)")
    p.add_argument("--batches", type=int, default=None, help="batches of the steady-rate comparison (default 96; quick 32)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the synthetic stores are written (and removed)")
    a = p.parse_args(argv)
    a.gb = a.gb or ([0.064, 1.0] if a.quick else [0.5, 8.0])
    a.batches = a.batches or (32 if a.quick else 96)
    return a


def write_store(root: Path, gb: float, hidden: int, seq_len: int) -> Path:
    """A one-shard store of boundaries 0 and 1 of ``gb`` GB each (bfloat16): returns its join folder."""
    import h5py

    from zgcore.data.boundary_store import FORMAT_VERSION, join_shards, sequence_checksums
    from zgcore.data.boundary_store.integrity import file_record

    seq_bytes = seq_len * hidden * 2
    rows = max(64, int(gb * 1e9 // seq_bytes) // 64 * 64)
    block = torch.randn(64, seq_len, hidden, generator=torch.Generator().manual_seed(0)).bfloat16().view(torch.uint16).numpy()
    sums = sequence_checksums(block)
    shard = root / "shards" / "train-00000000"
    shard.mkdir(parents=True)
    for b in (0, 1):
        with h5py.File(shard / f"b{b}.h5", "w") as f:
            h = f.create_dataset("h", shape=(rows, seq_len, hidden), dtype=np.uint16)
            for k in range(0, rows, 64):
                h[k: k + 64] = block
            f.create_dataset("xxh3", data=np.tile(sums, rows // 64))
            f.create_dataset("sumsq", data=np.ones((64, 2, hidden)), fletcher32=True)
    rec = {"format_version": FORMAT_VERSION, "split": "train", "lo": 0, "hi": rows, "boundaries": [0, 1], "dtype": "bfloat16",
           "teacher_dtype": "bfloat16", "seq_len": seq_len, "hidden_size": hidden, "batch_size": 8, "stats_rows": 64,
           "files": {f"b{b}": file_record(shard / f"b{b}.h5") for b in (0, 1)},
           "build_seconds": 0.0, "started": time.time(), "finished": time.time(), "peak_rss_mib": None}
    (shard / "shard.json").write_text(json.dumps(rec))
    join = root / "join"
    join.mkdir()
    join_shards(join, [shard], {"train": rows, "val": 0}, {})
    return join


def as_format_4(join: Path) -> Path:
    """A copy of ``join``'s manifest that reads the same files as format 4 (whole file hashed at open)."""
    old = join.parent / "join-format4"
    old.mkdir(exist_ok=True)
    m = json.loads((join / "manifest.json").read_text())
    m["format_version"] = 4
    for sh in m["shards"]:
        sh["dir"] = os.path.relpath((join / sh["dir"]).resolve(), old)
    (old / "manifest.json").write_text(json.dumps(m))
    for p in join.glob("stats-*.npy"):
        shutil.copy(p, old / p.name)
    return old


def first_batch(join: Path, seed: int) -> float:
    """Seconds from opening a reader to the first batch of both boundaries (8 random sequences)."""
    from zgcore.data.boundary_store import BoundaryReader

    t0 = time.perf_counter()
    with BoundaryReader(join) as r:
        idx = np.random.default_rng(seed).choice(r.n("train"), BATCH, replace=False)
        r.read("train", 0, idx), r.read("train", 1, idx)
    return time.perf_counter() - t0


def first_batch_prefetch(join: Path, seed: int, workers: int = 2) -> float:
    """Seconds to the first batch through the prefetch path (``workers`` thread workers)."""
    from zgcore.data.boundary_store import BoundaryReader
    from zgcore.data.feed import block_batches

    t0 = time.perf_counter()
    with BoundaryReader(join) as r:
        it = block_batches(r, 0, 1, r.n("train"), seed, BATCH, 0, 10_000, 2, workers=workers)
        next(it)
        it.close()
    return time.perf_counter() - t0


def drop_caches() -> str | None:
    """Drop the page cache; ``None`` on success, else why not."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return None
    except OSError as e:
        return str(e)


def steady(join: Path, batches: int) -> tuple[float, float]:
    """GB/s of stored bytes: through the prefetch path (two thread workers, default ahead, checked)
    and read directly with ``os.preadv`` (same sequences, no checks), over the same ``batches``
    batches of a shuffled order (warm)."""
    from zgcore.config.defaults import DEFAULTS
    from zgcore.data.boundary_store import BoundaryReader
    from zgcore.data.feed import block_batches
    from zgcore.data.order import data_order

    with BoundaryReader(join) as r:
        n = r.n("train")
        sh = r.shards["train"][0]
        files = [r._shard_dir(sh) / sh["files"][f"b{b}"]["name"] for b in (0, 1)]
        offsets = [sh["files"][f"b{b}"]["data"][0] for b in (0, 1)]
        seq_bytes = int(r.manifest["seq_len"]) * int(r.manifest["hidden_size"]) * 2
        order = data_order(n, 0, 0)[: batches * BATCH]
        nbytes = 2 * len(order) * seq_bytes
        buf = bytearray(BATCH * seq_bytes)
        fds = [os.open(f, os.O_RDONLY) for f in files]
        try:
            def direct() -> float:
                t0 = time.perf_counter()
                for k in range(0, len(order), BATCH):
                    for fd, off in zip(fds, offsets):
                        for i, s in enumerate(order[k: k + BATCH]):
                            os.preadv(fd, [memoryview(buf)[i * seq_bytes: (i + 1) * seq_bytes]], off + int(s) * seq_bytes)
                return time.perf_counter() - t0

            def prefetched() -> float:
                t0 = time.perf_counter()
                for _ in block_batches(r, 0, 1, n, 0, BATCH, 0, batches, int(DEFAULTS["train"]["prefetch"]), workers=2):
                    pass
                return time.perf_counter() - t0

            direct(), prefetched()  # warm
            d = min(direct() for _ in range(2))
            p = min(prefetched() for _ in range(2))
        finally:
            for fd in fds:
                os.close(fd)
    return nbytes / p / 1e9, nbytes / d / 1e9


def main(argv=None) -> int:
    a = parse(argv)
    if a.hidden < 2048:
        raise SystemExit("--hidden must be >= 2048 (a 7B-class width)")
    need = 2 * sum(a.gb) * 1e9 * 1.02
    free = shutil.disk_usage(a.dir).free
    if free < need + 4e9:
        raise SystemExit(f"{a.dir} has {free / 1e9:.1f} GB free; the stores need {need / 1e9:.1f} GB plus 4 GB spare")
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} on {os.cpu_count()} cores; "
          f"{free / 1e9:.0f} GB free in {a.dir}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="store_scale-", dir=a.dir))
    firsts, cold_ok = {}, None
    try:
        for gb in a.gb:
            t0 = time.perf_counter()
            join = write_store(root / f"s{gb:g}", gb, a.hidden, a.seq_len)
            size = json.loads((join / "manifest.json").read_text())["shards"][0]["files"]["b0"]["bytes"] / 1e9
            print(f"  wrote two files of {size:.2f} GB in {time.perf_counter() - t0:.1f} s", flush=True)
            first_batch(join, 99)  # the metadata into the page cache
            times = [first_batch(join, s) for s in range(a.repeats)]
            firsts[gb] = statistics.median(times)
            pre = statistics.median([first_batch_prefetch(join, 100 + s) for s in range(a.repeats)])
            old = first_batch(as_format_4(join), 200)
            print(f"first-batch {size:.2f} {firsts[gb]:.4f}", flush=True)
            print(f"first-batch-prefetch {size:.2f} {pre:.4f}  (two thread workers)", flush=True)
            print(f"format-4 first-batch {size:.2f} {old:.3f}  (the whole file hashed at open)", flush=True)
            why = drop_caches()
            if why is None:
                print(f"cold first-batch {size:.2f} {first_batch(join, 300):.4f}", flush=True)
            elif cold_ok is None:
                print(f"  cold: not measured (cannot drop the page cache: {why})", flush=True)
            cold_ok = why is None
            if gb == max(a.gb):
                pre_gbs, direct_gbs = steady(join, a.batches)
                print(f"steady {size:.2f}: prefetch {pre_gbs:.2f} GB/s, direct os.preadv {direct_gbs:.2f} GB/s", flush=True)
                print(f"prefetch/direct {pre_gbs / direct_gbs:.2f}", flush=True)
            shutil.rmtree(root / f"s{gb:g}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"first-batch ratio {firsts[max(a.gb)] / firsts[min(a.gb)]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
