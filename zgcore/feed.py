"""The input pipeline of cached training (issue 18): batches are read and checked ahead
of the training step by a worker process, at most ``ahead`` batches in flight, in the same order
and with the same bytes as a synchronous read.

It is PyTorch's own :class:`torch.utils.data.DataLoader` (worker processes over an
``IterableDataset``, each reading every ``workers``-th batch; ``prefetch_factor`` = ``ahead``;
``pin_memory`` on CUDA), not a hand-made queue. A process rather than a thread: h5py holds the GIL for the whole of each HDF5 read, so a
reading thread delays the training thread's kernel launches by up to a read plus Python's 5 ms
switch interval (measured: a 2 ms simulated step waited more with a reading thread than without
one). An error in the worker (a damaged shard: :class:`~zgcore.boundary_store.BoundaryStoreError`)
is handed over as a value and raised in the consumer with its own type and message, at the
batch that needed it.
"""
from __future__ import annotations

import multiprocessing
from functools import partial
from typing import Callable, Iterator, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

T = TypeVar("T")


class _Raised:
    """An exception raised by the source in the worker, carried to the consumer as a value."""

    def __init__(self, error: BaseException):
        self.error = error


class _Source(IterableDataset):
    """Worker ``w`` of ``W`` produces the items ``w, w+W, w+2W, ...`` of ``make_source(w, W)``;
    an exception ends them as a :class:`_Raised`."""

    def __init__(self, make_source: Callable[[int, int], Iterator]):
        super().__init__()
        self.make_source = make_source

    def __iter__(self):
        info = get_worker_info()
        try:
            yield from self.make_source(info.id, info.num_workers)
        except Exception as e:  # noqa: BLE001 (raised again, unchanged, in the consumer)
            yield _Raised(e)


def _as_is(item):
    return item


def _context() -> str:
    """``fork`` where there is one (the worker starts in milliseconds and inherits the source),
    else ``spawn`` (``make_source`` must then be picklable)."""
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def prefetch(make_source: Callable[[int, int], Iterator[T]], ahead: int, pin_memory: bool = False,
             workers: int = 1) -> Iterator[T]:
    """Yield the items of a source in order, produced ahead of the consumer by ``workers`` worker
    processes (``ahead`` <= 0: ``make_source(0, 1)`` itself, in this process).

    Worker ``w`` of ``W`` iterates ``make_source(w, W)``, which must yield the items ``w, w+W,
    w+2W, ...`` of the whole sequence (``make_source(0, 1)`` yields all of them); the DataLoader
    takes them from the workers in turn, so they come out in order. Each worker has at most
    ``ahead`` items requested and not yet handed out (``prefetch_factor``): while the consumer
    works on item ``i``, at most ``ahead * workers`` items beyond it are being produced or waiting,
    which bounds the memory held. Tensors cross through shared memory; with ``pin_memory`` (needs
    CUDA) they arrive in page-locked memory, ready for ``.to(device, non_blocking=True)``.

    An exception raised by the source is raised here, same type and message, when the consumer
    reaches the item that failed; the items before it are handed out first. Closing this
    generator stops the workers.

    Args:
        make_source: ``make_source(worker, workers)``, called once in each worker (picklable
            where there is no ``fork``; a :func:`functools.partial` of :func:`store_batches` is).
        ahead: items in flight per worker (>= 0). pin_memory: page-locked results (CUDA only).
        workers: worker processes (>= 1).
    """
    if ahead <= 0:
        yield from make_source(0, 1)
        return
    # a generator of its own: the DataLoader draws its workers' base seed from it, and drawing from
    # the global one would change the torch RNG state a checkpoint records
    loader = DataLoader(_Source(make_source), batch_size=None, num_workers=max(1, int(workers)),
                        prefetch_factor=int(ahead), pin_memory=pin_memory, collate_fn=_as_is,
                        multiprocessing_context=_context(), generator=torch.Generator().manual_seed(0))
    it = iter(loader)
    try:
        for item in it:
            if isinstance(item, _Raised):
                raise item.error
            yield item
    finally:
        it._shutdown_workers()  # at once, not when garbage collected


def store_batches(reader, b_in: int, b_out: int, n: int, seed: int, batch_size: int, start: int,
                  steps: int, worker: int = 0, workers: int = 1) -> Iterator[tuple[int, np.ndarray, torch.Tensor, torch.Tensor]]:
    """The batches of training steps ``start + worker, start + worker + workers, ...`` (below
    ``steps``; all of ``start .. steps-1`` by default) of a block: ``(step, idx, x, y)`` with
    ``idx`` the step's sequence indices (int64), ``x`` / ``y`` boundaries ``b_in`` / ``b_out``
    of those sequences (``[len(idx), seq_len, hidden]`` in the store's dtype, float32 / bfloat16 /
    float16, as :meth:`~zgcore.boundary_store.BoundaryReader.read` returns them: the consumer
    widens with ``.float()`` after copying them to its device). Step ``s`` is batch
    ``s % per_epoch`` of epoch ``s // per_epoch`` in :func:`zgcore.loop.data_order`.

    ``reader``: a :class:`~zgcore.boundary_store.BoundaryReader`, or the store's folder (opened
    here, and closed at the end: what a worker process does). Raises as the reader's ``read``.
    """
    from .boundary_store import BoundaryReader
    from .loop import data_order

    own = not isinstance(reader, BoundaryReader)
    r = BoundaryReader(reader) if own else reader
    per_epoch = (n + batch_size - 1) // batch_size
    epoch, order = -1, None
    try:
        for step in range(start + worker, steps, workers):
            e, k = divmod(step, per_epoch)
            if e != epoch:
                epoch, order = e, data_order(n, seed, e)
            idx = order[k * batch_size: (k + 1) * batch_size]
            yield step, idx, r.read("train", b_in, idx), r.read("train", b_out, idx)
    finally:
        if own:
            r.close()


def block_batches(reader, b_in: int, b_out: int, n: int, seed: int, batch_size: int, start: int, steps: int,
                  ahead: int, pin_memory: bool = False, workers: int = 1) -> Iterator[tuple[int, np.ndarray, torch.Tensor, torch.Tensor]]:
    """:func:`store_batches` of ``reader``, read ``ahead`` batches ahead by each of ``workers``
    worker processes that open the store themselves (:func:`prefetch`), or in this process with
    ``ahead`` = 0."""
    if ahead <= 0:
        return store_batches(reader, b_in, b_out, n, seed, batch_size, start, steps)
    return prefetch(partial(store_batches, str(reader.root), b_in, b_out, n, seed, batch_size, start, steps), ahead,
                    pin_memory, workers)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: an asynchronous copy (``non_blocking``) from page-locked memory to a
    CUDA device, a plain ``.to`` otherwise. The bytes and dtype are those of ``t`` either way
    (widen 16-bit boundaries with ``.float()`` afterwards, on the device)."""
    return t.to(device, non_blocking=device.type == "cuda" and t.is_pinned())
