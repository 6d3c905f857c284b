"""The deterministic data order every training stage shares: one seeded permutation per epoch,
a pure function of ``(n, seed, epoch)``, so that an interrupted run resumes on the same batches and a
prefetching reader reads ahead in the order the step will ask for.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np


def data_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Permutation of ``range(n)`` for ``epoch`` (int64); a pure function of its arguments."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_walk(n: int, seed: int, batch_size: int, start: int = 0, stop: int | None = None,
               stride: int = 1) -> Iterator[tuple[int, np.ndarray]]:
    """The training steps' batches, ``(step, idx)`` for steps ``start, start + stride, ...`` below
    ``stop`` (without end when ``None``): step ``s`` is batch ``s % per_epoch`` of epoch
    ``s // per_epoch`` of :func:`data_order`, ``per_epoch = ceil(n / batch_size)``, so an epoch's last
    batch may be short. ``idx`` holds the batch's sequence indices (int64, at most ``batch_size``).
    What every stage trained on a fixed split walks: a block on the boundary store or online, and
    end-to-end distillation; a resumed run starts at its step and sees the same batches."""
    per_epoch = (int(n) + int(batch_size) - 1) // int(batch_size)
    epoch, order, step = -1, None, int(start)
    while stop is None or step < stop:
        e, k = divmod(step, per_epoch)
        if e != epoch:
            epoch, order = e, data_order(n, seed, e)
        yield step, order[k * batch_size: (k + 1) * batch_size]
        step += stride


def total_steps(n_train: int, t: Mapping[str, Any]) -> int:
    """Optimizer steps for a block: ``max_steps`` if set, else ``ceil(epochs * batches_per_epoch)``
    (imports no torch: the planner counts steps with it too)."""
    if int(t.get("max_steps") or 0):
        return int(t["max_steps"])
    per_epoch = (n_train + int(t["batch_size"]) - 1) // int(t["batch_size"])
    return max(1, math.ceil(float(t["epochs"]) * per_epoch))
