"""Activation memory, measured: the bytes autograd keeps for backward (a saved-tensor meter) and
their peak over any forward/backward, plus CUDA's own peak counter where there is a GPU.

Generic: any model and any step; local learning uses it to compare its execution modes.
"""
from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable

import torch


class SavedTensorMeter:
    """Measure activation memory as the bytes autograd keeps for backward, live, and their peak.

    Inside the context every tensor saved for backward passes through
    ``torch.autograd.graph.saved_tensors_hooks``; its storage is counted once (by data pointer,
    ``untyped_storage().nbytes()``) while any saved reference to it lives, and released when the
    graph frees it (after backward, or when dropped). Parameters (and views of them) are not
    activations and are excluded. ``peak_bytes`` is the maximum live total (bytes).

    Why this and not a formula or RSS: on CPU the process's resident size is dominated by the
    allocator's caching and the other tensors of the process, and torch has no CPU peak counter;
    the saved-tensor set *is* the activation memory the two execution modes differ in, measured
    on the real forward/backward. On CUDA :func:`measure_peak` additionally reports
    ``torch.cuda.max_memory_allocated`` above the pre-forward baseline.
    """

    def __init__(self, params: Iterable[torch.Tensor]):
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self._refs: dict[int, int] = {}
        self._size: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def _pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key in self._param_ptrs or t.untyped_storage().nbytes() == 0:
            return t
        if self._refs.get(key, 0) == 0:
            self._size[key] = t.untyped_storage().nbytes()
            self.live_bytes += self._size[key]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] = self._refs.get(key, 0) + 1
        return _Saved(t, self, key)

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.live_bytes -= self._size.pop(key)
            del self._refs[key]

    @staticmethod
    def _unpack(obj):
        return obj.tensor if isinstance(obj, _Saved) else obj

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        return False


class _Saved:
    """A saved tensor held by the autograd graph; when the graph drops it, its count is released."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor, meter, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


def measure_peak(params: Iterable[torch.nn.Parameter], fn: Callable[[], Any], cuda: bool = False) -> dict[str, Any]:
    """Run ``fn()`` (a forward and backward) under a :class:`SavedTensorMeter` and return
    ``{"saved_peak_bytes", "cuda_peak_bytes"}`` (bytes; the second ``None`` unless ``cuda``, then
    ``torch.cuda.max_memory_allocated`` above the pre-``fn`` baseline). The gradients of ``params``
    are cleared afterwards, so a measurement leaves the parameters as they were."""
    params = list(params)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    meter = SavedTensorMeter(params)
    with meter:
        fn()
    cuda_peak = None
    if cuda:
        torch.cuda.synchronize()
        cuda_peak = int(torch.cuda.max_memory_allocated() - base)
    for p in params:
        p.grad = None
    return {"saved_peak_bytes": int(meter.peak_bytes), "cuda_peak_bytes": cuda_peak}


class PeakRSS:
    """Peak resident memory of the process while inside ``with PeakRSS() as m:`` → ``m.mib``.

    On Linux the kernel's peak (``VmHWM``) is reset at entry by writing ``5`` to
    ``/proc/self/clear_refs``, so the figure belongs to the block alone even when several tasks
    ran before in the same process; elsewhere (or if the reset is refused) it is the process's
    peak so far (``ru_maxrss``), an upper bound, and ``m.exact`` is ``False``. Also usable as
    ``m = PeakRSS().start()`` ... ``m.stop()`` (returns MiB).
    """

    def start(self) -> PeakRSS:
        """Reset the peak (see above); returns ``self``."""
        return self.__enter__()

    def stop(self) -> float:
        """The peak resident memory since :meth:`start`, MiB."""
        self.__exit__(None, None, None)
        return self.mib

    def __enter__(self):
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.exact = True
        except OSError:
            self.exact = False
        return self

    def __exit__(self, *exc):
        self.mib = _vm_hwm_mib() if self.exact else None
        if self.mib is None:
            self.exact = False
            self.mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        return False


def _vm_hwm_mib() -> float | None:
    try:
        for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None
