"""What checking a shard file's bytes costs, against one training read of it through today's read
path (:class:`zgcore.data.boundary_store.BoundaryReader`: ``os.preadv`` and an xxh3_64 per
sequence, batches of a shuffled order).

    python bench/integrity_cost.py [--gb 0.5] [--hidden 2048] [--batch 8]

A synthetic store of two boundary files (:mod:`bench.store_scale`, bfloat16) is read warm (page
cache), so the figures compare CPU costs, not the disk. Printed: the whole-file SHA-256 (what a
reader of a format-4 store did at open, and what ``zerograph verify`` does), the SHA-256 of the
bytes outside the sequence data (what a format-5 reader does at open), one training read of the
same files, and their ratios.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main() -> None:
    from bench.store_scale import write_store
    from zgcore.data.boundary_store import BoundaryReader
    from zgcore.data.boundary_store.integrity import outside_sha256, sha256_with_progress, store_shards

    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=0.5, help="GB per boundary file")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="integrity_cost-"))
    try:
        join = write_store(root / "s", a.gb, a.hidden, 256)
        (folder, files), = store_shards(join)
        paths = [(folder / e["name"], e) for e in files.values()]
        size = sum(p.stat().st_size for p, _ in paths)
        for p, _ in paths:
            sha256_with_progress(p)  # warm the page cache
        t0 = time.perf_counter()
        for p, _ in paths:
            sha256_with_progress(p)
        t_whole = time.perf_counter() - t0
        t0 = time.perf_counter()
        for p, e in paths:
            outside_sha256(p, e["data"])
        t_open = time.perf_counter() - t0
        with BoundaryReader(join) as r:
            order = np.random.default_rng(0).permutation(r.n("train"))
            t0 = time.perf_counter()
            for _ in r.batches("train", 0, 1, order, a.batch):
                pass
            t_read = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()
    print(f"two shard files of {size / 2 / 1e9:.2f} GB (hidden {a.hidden} bfloat16); load average {load[0]:.1f} on {os.cpu_count()} cores")
    print(f"whole-file SHA-256       {t_whole:7.3f} s  {size / t_whole / 1e9:5.2f} GB/s  (format 4 at open; zerograph verify)")
    print(f"outside-data SHA-256     {t_open:7.3f} s  (format 5 at open)")
    print(f"one training read        {t_read:7.3f} s  {size / t_read / 1e9:5.2f} GB/s  (batches of {a.batch}, xxh3 per sequence)")
    print(f"whole hash / read = {t_whole / t_read:.2f}; open check / read = {t_open / t_read:.4f}")


if __name__ == "__main__":
    main()
