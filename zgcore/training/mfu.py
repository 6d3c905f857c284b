"""Model FLOPs utilisation (MFU): the FLOP rate a phase achieved over the peak this process can
reach, measured by a short matmul probe in the same process (torchtitan and Megatron-LM print the
same ratio beside loss and throughput). The FLOPs of each phase are counted in one module,
:mod:`zgcore.evaluation.flops`; this one only measures the peak and divides.

The probe: square matmuls of ``PROBE_N`` (CPU, float32 at torch's current thread count) or
``PROBE_N_CUDA`` (CUDA, bfloat16) rows, ``PROBE_WARMUP`` warm-ups, then the best of at least
``PROBE_REPEATS`` timed calls spread over at least ``PROBE_SECONDS``, at ``2 n^3`` FLOPs each. It
is taken once per process, device and thread count and recorded with every figure divided by it.
The window is that long because a short one is lowered by any stall of a shared machine longer
than it (figures: docs/performance.md, "Compute utilisation (MFU)").
"""
from __future__ import annotations

import time
from typing import Any

PROBE_N = 512
PROBE_N_CUDA = 4096
PROBE_REPEATS = 40
PROBE_WARMUP = 3
PROBE_SECONDS = 0.3
_peaks: dict[tuple[str, int], dict[str, Any]] = {}


def probe(device: str = "cpu") -> dict[str, Any]:
    """The peak matmul rate of this process on ``device`` (measured once per device and torch
    thread count, then remembered): ``{"device", "dtype", "threads", "n", "peak_flops_per_second"}``
    (FLOP/s; ``dtype`` is ``float32`` on CPU, ``bfloat16`` on CUDA).

    Raises:
        RuntimeError: a CUDA device was asked for and none is available.
    """
    import torch

    from zgcore.device import resolve

    dev = resolve(str(device))
    key = (str(dev), torch.get_num_threads())
    if key in _peaks:
        return _peaks[key]
    cuda = dev.type == "cuda"
    n, dtype = (PROBE_N_CUDA, torch.bfloat16) if cuda else (PROBE_N, torch.float32)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dev, dtype)
    b = torch.randn(n, n, generator=gen).to(dev, dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    best, i, start = float("inf"), 0, time.perf_counter()
    while i < PROBE_WARMUP + PROBE_REPEATS or time.perf_counter() - start < PROBE_SECONDS:
        sync()
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        if i >= PROBE_WARMUP:  # the first calls warm the thread pool and caches up
            best = min(best, time.perf_counter() - t0)
        i += 1
    _peaks[key] = {"device": str(dev), "dtype": str(dtype).replace("torch.", ""), "threads": key[1], "n": n,
                   "peak_flops_per_second": 2.0 * n ** 3 / best}
    return _peaks[key]


def utilisation(flops: int, seconds: float, device: str = "cpu") -> dict[str, Any]:
    """A phase's FLOPs against this process's peak: ``{"flops", "flops_per_second", "mfu",
    "peak": probe(device)}`` (``flops_per_second`` and ``mfu`` are None when ``seconds`` is not
    positive)."""
    peak = probe(device)
    rate = flops / seconds if seconds > 0 else None
    return {"flops": int(flops), "flops_per_second": rate,
            "mfu": rate / peak["peak_flops_per_second"] if rate is not None else None, "peak": peak}
