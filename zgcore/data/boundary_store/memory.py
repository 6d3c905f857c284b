"""Batch memory of the boundary reader: tensors it hands out and writes again only once nothing
else refers to them, and where a prefetch worker process makes it take them from
(:mod:`zgcore.data.process_workers`)."""
from __future__ import annotations

import sys

import torch

# Batch tensors a reader keeps for reuse, per shape: a returned batch's memory is written again only
# once nothing but the pool refers to it (its Python object nor any view, saved tensor or copy of its
# storage). Reusing pages already mapped avoids a fresh allocation's page faults and, when it is
# freed, the unmapping that interrupts every core running this process (bench/README.md).
POOL_SIZE = 16
# where a reader in a prefetch worker process takes its batch tensors (zgcore.data.process_workers): shared
# memory lent to the training process, so a batch crosses with no copy; None elsewhere
allocate = None


def set_allocator(take) -> None:
    """Make every reader of this process take its unpinned batch tensors from ``take(shape,
    dtype)`` (a tensor, or None for an ordinary one), or stop with ``None``. For a prefetch worker
    process, which owns its process (:mod:`zgcore.data.process_workers`)."""
    global allocate
    allocate = take


def unshared(t: torch.Tensor, sent: bool = False) -> bool:
    """True when only the reader's pool refers to ``t``: it was never sent to another process (its
    storage is not in shared memory), no other Python reference to the tensor (``sys.getrefcount``:
    the pool's list and the call's argument) and no other tensor or autograd record on its storage
    (its use count: ``t`` and the temporary storage object), nor to the storage's Python object (its
    reference count: the local name, the call's argument and torch's own). ``sent``: ``t`` is a shared-memory
    buffer of a prefetch worker (:mod:`zgcore.data.process_workers`), written only when given back."""
    if not sent and t.is_shared():  # handed to another process (torch moved it into shared memory to send it): never reused
        return False
    if sys.getrefcount(t) > 3:
        return False
    st = t.untyped_storage()  # the one Python object of the storage: a consumer keeping it holds the memory too
    return torch._C._storage_Use_Count(st._cdata) <= 2 and sys.getrefcount(st) <= 3


def batch_tensor(pool: dict, shape: tuple, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    """A tensor ``shape`` of ``dtype`` for a reader's batch: from this process's allocator where one
    is set (:func:`set_allocator`), else one of ``pool[shape]`` that nothing else refers to any
    more (:func:`unshared`), else a new one (kept in the pool, up to ``POOL_SIZE`` per shape).
    Page-locked tensors (``pin_memory``) come from torch's caching host allocator, never the pool:
    an asynchronous copy to the GPU may still be reading one that Python no longer refers to."""
    if allocate is not None and not pin_memory:
        out = allocate(shape, dtype)
        if out is not None:
            return out
    have = pool.get(shape, []) if not pin_memory else []
    for i in range(len(have)):
        if unshared(have[i]):  # no local name for it while asking: that would be a reference
            return have[i]
    out = torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
    if not pin_memory and len(pool.setdefault(shape, [])) < POOL_SIZE:
        pool[shape].append(out)
    return out
