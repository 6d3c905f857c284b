"""The deterministic data order every training stage shares: one seeded permutation per epoch,
a pure function of ``(n, seed, epoch)``, so that an interrupted run resumes on the same batches and a
prefetching reader reads ahead in the order the step will ask for.
"""
from __future__ import annotations

import numpy as np


def data_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Permutation of ``range(n)`` for ``epoch`` (int64); a pure function of its arguments."""
    return np.random.default_rng([seed, epoch]).permutation(n)
