"""Figure 1: cache build time / teacher forward-only time over the same tokens.

The cache build is :func:`zgcore.data.boundary_store.build_store` (every shard: every boundary
captured, checked finite, rounded to the storage dtype, written to checksummed HDF5 with its
SHA-256; then the join's manifest and statistics; atomic rename). The physical floor is the
same teacher forwards with only the last boundary captured and nothing written
(:func:`zgcore.models.adapters.capture_boundaries` with ``[n_layers]``), over the same rows with the
same batch size.

The two are interleaved batch by batch so that a neighbour's load on a shared machine hits both
alike: build_store calls its ``progress`` hook after each batch, and the hook runs the
forward-only pass on the rows just written. The hook's own time is subtracted from build_store's
wall time.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from zgcore.models.adapters import capture_boundaries
from zgcore.data.boundary_store import build_store


def measure(teacher, tokens: dict[str, np.ndarray], boundaries: list[int], dtype: str, batch_size: int,
            path: Path) -> dict:
    """Build the store at ``path`` and time it against forward-only passes. Returns seconds and the ratio."""
    last = max(boundaries)
    rows = np.concatenate([tokens["train"], tokens["val"]])
    # warm-up (untimed): the first forward of a process pays one-off allocation costs
    capture_boundaries(teacher, torch.from_numpy(rows[:batch_size].astype(np.int64)), [last])

    state = {"prev": 0, "fwd": 0.0, "hook": 0.0, "batches": []}

    def hook(done: int, total: int) -> None:
        h0 = time.perf_counter()
        ids = torch.from_numpy(rows[state["prev"]: done].astype(np.int64))
        f0 = time.perf_counter()
        capture_boundaries(teacher, ids, [last])
        f1 = time.perf_counter()
        state["fwd"] += f1 - f0
        state["batches"].append(f1 - f0)
        state["prev"] = done
        state["hook"] += time.perf_counter() - h0

    t0 = time.perf_counter()
    man = build_store(path, teacher, tokens, boundaries, dtype, batch_size, {"bench": True}, progress=hook,
                      log=lambda m: None)
    total = time.perf_counter() - t0
    build = total - state["hook"]
    return {"sequences": int(len(rows)), "tokens": int(rows.size), "build_s": build, "forward_s": state["fwd"],
            "ratio": build / state["fwd"], "store_bytes": man["bytes"]}
