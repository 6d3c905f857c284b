"""What checking every byte of a shard file costs: SHA-256 of the file (done once, when a task
first opens it) against one training pass over it (batches of rows read through h5py with
Fletcher32, as :class:`zgcore.data.boundary_store.BoundaryReader` reads them).

    python bench/integrity_cost.py [--mb 256] [--batch 8]

The file is written with the store's layout (one chunk per sequence, Fletcher32) and read warm
(page cache) both ways, so the figures compare CPU costs, not the disk.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main() -> None:
    from zgcore.data.boundary_store import from_storage
    from zgcore.hashing import file_sha256

    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=256)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    seq, hidden = 256, 576  # SmolLM2-135M's width
    rows = max(1, int(a.mb * 2**20 / (seq * hidden * 4)))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "b0.h5"
        rng = np.random.default_rng(0)
        with h5py.File(path, "w") as f:
            ds = f.create_dataset("h", (rows, seq, hidden), np.float32, chunks=(1, seq, hidden), fletcher32=True)
            for i in range(rows):
                ds[i] = rng.standard_normal((seq, hidden), dtype=np.float32)
        size = path.stat().st_size
        file_sha256(path)  # warm the page cache
        t0 = time.perf_counter()
        file_sha256(path)
        t_hash = time.perf_counter() - t0
        order = rng.permutation(rows)
        t0 = time.perf_counter()
        with h5py.File(path, "r") as f:
            for k in range(0, rows, a.batch):
                from_storage(f["h"][np.sort(order[k: k + a.batch])], "float32")
        t_read = time.perf_counter() - t0
    print(f"shard file {size / 2**20:.0f} MiB ({rows} sequences of {seq} x {hidden} float32)")
    print(f"SHA-256 once      {t_hash:6.2f} s  {size / t_hash / 1e9:5.2f} GB/s")
    print(f"one training read {t_read:6.2f} s  {size / t_read / 1e9:5.2f} GB/s (batches of {a.batch}, Fletcher32)")
    print(f"hash / read = {t_hash / t_read:.2f} (per epoch: the hash runs once per task, the read once per epoch)")


if __name__ == "__main__":
    main()
