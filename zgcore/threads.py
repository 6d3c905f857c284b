"""How many threads torch computes with, chosen per task.

torch's default is one intra-op thread per core of the host. For a tiny model that is slow on a
busy machine: each matrix product is split over every core, and when another process holds one
core each split waits for it (figures: docs/CHANGES.md). So a task asks for threads in proportion
to the work in one of its matrix products — the model's parameters, :data:`PARAMS_PER_THREAD` per
thread — and never more than the cores this process may use (its CPU affinity and its cgroup's CPU
quota); a tiny model gets one. ``OMP_NUM_THREADS`` in the environment, else an explicit count (Luigi's
``[zerograph] threads`` in ``luigi.cfg``, or ``--zerograph-threads N``), wins over the choice.
None of it is hashed: results do not depend on the thread count.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

# Parameters per thread: below ~2M parameters (hidden sizes of a few hundred) a matrix product is too
# small to split with profit; SmolLM2-135M (~100M non-embedding parameters) gets every core.
PARAMS_PER_THREAD = 2_000_000
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup in cores (cgroup v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us / cpu.cfs_period_us``), or ``None`` when there is none or it cannot be read."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def usable_cores(root: Path = CGROUP_ROOT) -> int:
    """Cores this process may use: its CPU affinity (``os.sched_getaffinity``), capped by its
    cgroup's CPU quota rounded down (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cores = min(cores, max(1, math.floor(limit)))
    return max(1, cores)


def choose_threads(params: int | None, setting: int = 0, cores: int | None = None,
                   env: dict[str, str] | None = None) -> tuple[int, str]:
    """``(threads, why)`` for a task whose model has ``params`` parameters (``None``: unknown).

    ``OMP_NUM_THREADS`` in ``env`` (default: the environment) wins, then ``setting`` (> 0), then
    ``ceil(params / PARAMS_PER_THREAD)`` capped by ``cores`` (default: :func:`usable_cores`); an
    unknown size gets every usable core (torch's own default on an idle host).

    Raises:
        ValueError: ``OMP_NUM_THREADS`` is set but not a positive integer, or ``setting`` < 0.
    """
    env = os.environ if env is None else env
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp:
        if not omp.isdigit() or int(omp) < 1:
            raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {omp!r}")
        return int(omp), "OMP_NUM_THREADS"
    if setting < 0:
        raise ValueError(f"[zerograph] threads must be >= 0 (0 = chosen per task), got {setting}")
    if setting:
        return int(setting), "[zerograph] threads"
    cores = usable_cores() if cores is None else cores
    if params is None:
        return cores, f"{cores} usable core(s), model size unknown"
    return max(1, min(cores, math.ceil(params / PARAMS_PER_THREAD))), \
        f"{params / 1e6:.2f}M parameters, {cores} usable core(s)"


def apply_threads(params: int | None, setting: int = 0) -> tuple[int, str]:
    """Choose (:func:`choose_threads`) and set torch's intra-op thread count for this process;
    return ``(threads, why)``."""
    import torch

    n, why = choose_threads(params, setting)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n, why


def decoder_params(n_layers: int, hidden: int, mlp: int | None = None) -> int:
    """Rough non-embedding parameter count of a decoder: per layer 4 h^2 (attention) + 3 h m (gated
    MLP, m = ``mlp`` or 4 h). Enough to size the thread count, not a model card's figure."""
    mlp = mlp or 4 * hidden
    return int(n_layers) * (4 * hidden * hidden + 3 * hidden * mlp)
