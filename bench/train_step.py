"""Figures 2 and 3: what the data path costs a TrainBlock.

Figure 2: per-step time of :func:`zgcore.training.blocks.train_block` reading from the boundary store
(:class:`~zgcore.data.boundary_store.BoundaryReader`) / the same steps fed from tensors already in
memory (:class:`bench.common.InMemoryBoundaries`), on block 0.

Figure 3: per block, the wall time of a TrainBlock with online targets
(:class:`~zgcore.data.boundary_store.OnlineBoundaries`: statistics pass plus a teacher forward per
batch) / the same block with cached targets (open the store, train). The cache build time over
the per-experiment saving gives the break-even reuse count.

Every run trains a fresh block with the same seed, so all three sources must give bitwise the
same weights; that is checked and reported.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from zgcore.models.adapters import build_block
from zgcore.data.boundary_store import BoundaryReader, OnlineBoundaries
from zgcore.training.blocks import BlockTraining, block_seed, train_block

from .common import InMemoryBoundaries, log


def _train(teacher, kept, i, b_in, b_out, t, make_source, workdir: Path, tag: str) -> dict:
    seed = block_seed(int(t["seed"]), i)
    block = build_block(teacher, kept, t["init"], seed)
    work = Path(tempfile.mkdtemp(prefix=f"{tag}-b{i}-", dir=workdir))
    t0 = time.perf_counter()
    with make_source() as source:
        m = train_block(block, source, b_in, b_out, BlockTraining(t, seed, work, run_hash=tag))
    m["wall_s"] = time.perf_counter() - t0
    m["step_s"] = m["seconds"] / max(1, m["steps"])
    m["teacher_s"] = getattr(source, "teacher_seconds", 0.0)
    m["weights"] = block.layer_state_dict()
    return m


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)


def measure(teacher, store: Path, train_tokens: np.ndarray, boundaries: list[int], kept: list[list[int]], t: dict,
            dtype: str, cache_batch_size: int, build_s: float, workdir: Path) -> dict:
    """Run figure 2 on block 0 and figure 3 on every block; ``build_s`` is the cache build time."""
    K = len(boundaries) - 1
    with BoundaryReader(store) as r:
        mem = InMemoryBoundaries(r, boundaries[:2])
    # warm-up (untimed): one step, so no timed run pays the process's first-step costs
    _train(teacher, kept[0], 0, boundaries[0], boundaries[1], {**t, "max_steps": 1}, lambda: mem, workdir, "warmup")

    log("figure 2: block 0 from memory, then from the store")
    m_mem = _train(teacher, kept[0], 0, boundaries[0], boundaries[1], t, lambda: mem, workdir, "memory")
    mem = None  # the in-memory boundaries are freed before the cached runs
    blocks = []
    for i in range(K):
        b_in, b_out = boundaries[i], boundaries[i + 1]
        log(f"figure 3: block {i} ({b_in}->{b_out}, {len(kept[i])} layers) cached, then online")
        cached = _train(teacher, kept[i], i, b_in, b_out, t, lambda: BoundaryReader(store), workdir, "cached")
        online = _train(teacher, kept[i], i, b_in, b_out, t,
                        lambda b_in=b_in, b_out=b_out: OnlineBoundaries(teacher, train_tokens, [b_in, b_out], dtype,
                                                                        cache_batch_size),
                        workdir, "online")
        blocks.append({"block": i, "b_in": b_in, "b_out": b_out, "layers": len(kept[i]), "steps": cached["steps"],
                       "cached_wall_s": cached["wall_s"], "online_wall_s": online["wall_s"],
                       "cached_step_s": cached["step_s"], "cached_data_s": cached["data_seconds"],
                       "online_teacher_s": online["teacher_s"], "ratio": online["wall_s"] / cached["wall_s"],
                       "identical": _same(cached["weights"], online["weights"]),
                       "_cached_weights": cached["weights"] if i == 0 else None})
    c0 = blocks[0]
    fig2 = {"steps": m_mem["steps"], "memory_step_s": m_mem["step_s"], "cached_step_s": c0["cached_step_s"],
            "ratio": c0["cached_step_s"] / m_mem["step_s"], "cached_data_share": c0["cached_data_s"] / (c0["cached_step_s"] * c0["steps"]),
            "identical": _same(m_mem["weights"], c0.pop("_cached_weights"))}
    for b in blocks:
        b.pop("_cached_weights", None)
    saving = sum(b["online_wall_s"] - b["cached_wall_s"] for b in blocks)
    fig3 = {"blocks": blocks, "build_s": build_s, "saving_per_experiment_s": saving,
            "online_wall_s": sum(b["online_wall_s"] for b in blocks),
            "cached_wall_s": sum(b["cached_wall_s"] for b in blocks),
            # reuses of the cache (full K-block experiments) after which building it has paid off
            "break_even_experiments": build_s / saving if saving > 0 else float("inf"),
            "break_even_blocks": build_s / (saving / K) if saving > 0 else float("inf"),
            "identical": all(b["identical"] for b in blocks)}
    fig3["ratio"] = fig3["online_wall_s"] / fig3["cached_wall_s"]
    return {"fig2": fig2, "fig3": fig3}
