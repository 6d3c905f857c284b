"""Device helpers: resolve a device string lazily (CUDA is touched only inside a task's run),
and bf16 autocast on GPU."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


DTYPE_NAMES = ("float32", "float16", "bfloat16")  # the storage and compute dtypes a task may name


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` / ``"float16"`` / ``"bfloat16"`` → the ``torch.dtype`` (torch imported here, not at
    module import). Raises ``ValueError`` naming the allowed names for any other string."""
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {name!r}")
    return getattr(torch, name)


def resolve(device: str) -> torch.device:
    """``"cpu"``, ``"cuda"``, ``"cuda:1"``... → ``torch.device``.

    Raises:
        RuntimeError: a CUDA device was asked for and none is available.
    """
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r} was asked for but torch sees no CUDA device; use device=cpu")
    return dev


def precision(device: torch.device | str) -> str:
    """The compute precision a task runs at on ``device``: ``"bf16-autocast"`` on CUDA (see
    :func:`autocast`), ``"float32"`` elsewhere. Part of every device task's hash: results computed
    at another precision never share an output name or a checkpoint. Parses the string only; CUDA
    is not initialised, nor torch imported (task hashes are taken while the graph is built)."""
    return "bf16-autocast" if str(device).split(":")[0] == "cuda" else "float32"


def autocast(device: torch.device | str):
    """bf16 autocast on CUDA; a no-op context on CPU (CPU runs stay float32 and bit-reproducible)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """The one way a batch reaches the training device. On CUDA: from page-locked memory (``t`` as
    it is when already pinned, e.g. read straight into pinned memory by the input pipeline, else a
    pinned copy made here) with a ``non_blocking`` copy, so that the host queues the next step while
    the device computes this one. Elsewhere (CPU) a plain ``.to``; a tensor already on ``device``
    is returned as it is. The bytes and dtype are those of ``t`` (widen 16-bit boundaries with
    ``.float()`` afterwards, on the device). Raises as ``Tensor.to``."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and t.device.type == "cpu":
        return (t if t.is_pinned() else t.pin_memory()).to(dev, non_blocking=True)
    return t.to(dev)
