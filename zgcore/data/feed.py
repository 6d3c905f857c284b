"""The input pipeline of cached training: batches are read and checked ahead
of the training step by background workers, at most ``ahead`` batches in flight per worker, in the
same order and with the same bytes as a synchronous read.

Two kinds of worker (``train.prefetch_mode``; the default, ``"auto"``, picks one per block by
:func:`choose_mode`: threads on a CPU and for an accelerator's small batches, processes for an
accelerator's batches of 12 MiB and more), ``train.prefetch_workers`` of them (default ``"auto"``:
:func:`choose_workers`, two for an accelerator, one on a CPU):

* ``"process"``: worker processes (``fork`` where there is one), each reading every
  ``workers``-th batch and checking it in its own interpreter, so its Python never holds the
  training thread's GIL. A batch crosses in one of a few shared-memory buffers the worker reuses
  (:func:`zgcore.data.process_workers.processes`): the training thread receives one small message per batch and never maps a
  fresh buffer or receives a file descriptor per tensor (PyTorch's DataLoader, used before, did:
  ~1-5 ms per batch). With ``pin_memory`` (CUDA) one thread of the training process copies each
  batch into page-locked memory (two GIL-free copies per batch) so that the step's
  ``.to(device, non_blocking=True)`` is asynchronous.
* ``"thread"``: threads of this process, each iterating its share of the batches into a queue
  bounded by a semaphore (the standard library's ``threading`` and ``queue``); a batch reaches the
  step as the very tensor the worker filled (page-locked when asked: no second copy). A format-4+
  store is read with ``os.preadv`` and checked with xxh3, each call of which releases the GIL and
  takes it back (two hand-overs per sequence read, and the reader's Python between them runs under
  the training thread's GIL). A format-3 store is always read by processes (h5py holds the GIL for
  the whole of each Fletcher32-filtered read).

Measured (``bench/data_feed.py --slowdown-only``, 2026-12-03, quiet 2-core machine, 16 MiB batches
of hidden 2048 bfloat16, a training-like loop of 32-38 ms steps of small torch ops): reading and
checking one batch ahead cost the training thread 1.2-3.8% of a step with two worker processes and
3.5-9.2% with two worker threads (the lower end with the threads kept off the training thread's core,
``--pin``); ``bench/README.md``. A process's batch costs the consumer 0.16-0.35 ms (a pipe read and
one small message back; a thread's small batch 0.04-0.14 ms, ``bench/handover_cost.py``): with small
batches and steps under ~5 ms threads cost less, which is what ``"auto"`` picks.

Either way an error in a worker (a damaged shard: :class:`~zgcore.data.boundary_store.BoundaryStoreError`)
is handed over as a value and raised in the consumer with its own type and message, at the batch
that needed it.
"""
from __future__ import annotations

import time
from functools import partial
from typing import TypeVar
from collections.abc import Callable, Iterator

import numpy as np
import torch

from zgcore.data.handover import CLOSE_WAIT_S, PrefetchError, _Raised, _take, same_kind  # noqa: F401 (PrefetchError: raised here, by name)

T = TypeVar("T")


MODES = ("thread", "process")
#: the batch size, in bytes, from which ``"auto"`` feeds an accelerator from worker processes: between
#: the two accelerator regimes measured (9.4 MB batches, where threads cost less, and 16.8 MB, where
#: processes do); a batch between them has not been measured
AUTO_PROCESS_BYTES = 12 << 20


def choose_mode(batch_bytes: int, accelerator: bool) -> str:
    """The kind of worker ``train.prefetch_mode = "auto"`` (the default) feeds a block with:
    ``"process"`` for an accelerator's batches of at least :data:`AUTO_PROCESS_BYTES` (12 MiB),
    ``"thread"`` otherwise.

    The rule follows what each kind costs the training thread per batch, measured on this project's
    2-core CPU machine (docs/performance.md, "The prefetch default, by measurement at both ends"):

    * a worker process's batch costs a fixed hand-over (a pipe read and a small message back,
      0.16-0.6 ms): 15-28% of a 2 ms accelerator step fed 9.4 MB batches, where threads cost 1-2%
      (two workers);
    * a worker thread's reads hand the GIL back and forth twice per sequence read, which costs a step
      that holds the GIL (an accelerator's launch-bound Python): beside a 35 ms step fed 16.8 MB
      batches, 3.5-9.2% from threads against 1.2-3.8% from processes;
    * on a CPU a step computes for far longer than its batch takes to read (the default experiment:
      a 4.7 MB batch read and checked in 1.0 ms of one core, against a 1.4 s step; a thread worker
      left it waiting 0.11% of the time), so both kinds cost well under 2%, and a thread spares the
      worker process's start (0.5-1 s on each block's first step) and a third process on the cores.

    Args:
        batch_bytes: bytes of one step's batch as stored (all its arrays). accelerator: the step
            runs on CUDA (its batches are page-locked).

    Returns:
        ``"thread"`` or ``"process"``.
    """
    return "process" if accelerator and int(batch_bytes) >= AUTO_PROCESS_BYTES else "thread"


def choose_workers(accelerator: bool) -> int:
    """How many workers ``train.prefetch_workers = "auto"`` (the default) starts: 2 for an
    accelerator, 1 on a CPU.

    One reader alone barely keeps ahead of a short accelerator step: on this project's 2-core
    machine a 9.4 MB batch takes one worker 1.4-1.9 ms to read and check, and beside a 2 ms step one
    worker thread left the step waiting 0.8-11.2% of the time over five runs, two 1.0-1.7% over
    four (``bench/data_feed.py --quick [--workers 2]``, docs/performance.md). A CPU step computes
    for far longer than a batch takes to read: one worker waits 0.1% of the default experiment's step.
    """
    return 2 if accelerator else 1


def resolve_feed(mode: str, workers: int | str, batch_bytes: int, accelerator: bool) -> tuple[str, int]:
    """``(mode, workers)`` with each ``"auto"`` replaced by :func:`choose_mode` /
    :func:`choose_workers`; explicit settings are kept as given (``workers`` as an int)."""
    if mode == "auto":
        mode = choose_mode(batch_bytes, accelerator)
    return mode, choose_workers(accelerator) if workers == "auto" else max(1, int(workers))


def prefetch(make_source: Callable[[int, int], Iterator[T]], ahead: int, pin_memory: bool = False,
             workers: int = 1, mode: str = "thread") -> Iterator[T]:
    """Yield the items of a source in order, produced ahead of the consumer by ``workers`` worker
    threads or processes (``mode``; ``ahead`` <= 0: ``make_source(0, 1)`` itself, in this thread).

    Worker ``w`` of ``W`` iterates ``make_source(w, W)``, which must yield the items ``w, w+W,
    w+2W, ...`` of the whole sequence (``make_source(0, 1)`` yields all of them); the consumer
    takes them from the workers in turn, so they come out in order. Each worker has at most
    ``ahead`` items produced and not yet handed out: while the consumer works on item ``i``, at
    most ``ahead * workers`` items beyond it are being produced or waiting, which bounds the memory
    held. From worker processes, an item's tensors (the item itself, or a tuple's elements) arrive
    in shared-memory buffers that are written again only once nothing in this process refers to
    them: keep an item as long as you like, it is never overwritten. With ``pin_memory`` (needs
    CUDA) they arrive in page-locked memory, ready for ``.to(device, non_blocking=True)``.

    An exception raised by the source is raised here, same type and message, when the consumer
    reaches the item that failed; the items before it are handed out first. Closing this
    generator stops the workers.

    Args:
        make_source: ``make_source(worker, workers)``, called once in each worker (picklable
            where there is no ``fork``; a :func:`functools.partial` of :func:`store_batches` is).
        ahead: items in flight per worker (>= 0). pin_memory: page-locked results (CUDA only).
        workers: worker threads or processes (>= 1).
        mode: ``"thread"`` or ``"process"`` (see the module's docstring).

    Raises:
        ValueError: an unknown ``mode``. PrefetchError: a worker ended without handing anything
            over. Whatever the source raises, at its item (same type and message).
    """
    if mode not in MODES:
        raise ValueError(f"prefetch mode must be one of {', '.join(MODES)}, got {mode!r}")
    if ahead <= 0:
        yield from make_source(0, 1)
        return
    if mode == "thread":
        yield from _threaded(make_source, int(ahead), pin_memory, max(1, int(workers)))
        return
    if pin_memory:  # one thread of this process copies each item into page-locked memory, off the training thread
        from .process_workers import processes

        yield from _threaded(lambda w, n: processes(make_source, int(ahead), max(1, int(workers))), 1, True, 1)
        return
    from .process_workers import processes

    yield from processes(make_source, int(ahead), max(1, int(workers)))


_END = object()


def _pinned(item):
    """``item`` (a tensor, or a tuple of tensors and other values) with its tensors in page-locked memory."""
    if isinstance(item, torch.Tensor):
        return item if item.is_pinned() else item.pin_memory()
    if isinstance(item, tuple):
        values = [_pinned(x) for x in item]
        return same_kind(item, values)
    return item


def _threaded(make_source: Callable[[int, int], Iterator[T]], ahead: int, pin_memory: bool, workers: int) -> Iterator[T]:
    """:func:`prefetch` with worker threads: worker ``w`` takes a slot (one of ``ahead``) before it
    produces an item and the consumer gives it back when it takes the item, so at most ``ahead``
    items per worker are being produced or waiting; the consumer takes item ``k`` from worker
    ``k % workers``. Closing the generator stops the workers (each at its next slot) and waits for
    them at most ``CLOSE_WAIT_S`` seconds in all.

    Raises:
        PrefetchError: a worker thread ended without handing anything over."""
    import queue
    import threading

    stop = threading.Event()
    slots = [threading.Semaphore(ahead) for _ in range(workers)]
    queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(workers)]

    def work(w: int) -> None:
        source = None
        try:
            source = make_source(w, workers)  # may raise too: handed over like any error of the source
            while True:
                while not slots[w].acquire(timeout=0.05):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                try:
                    item = next(source)
                except StopIteration:
                    queues[w].put(_END)
                    return
                queues[w].put(_pinned(item) if pin_memory else item)
        except BaseException as e:  # noqa: BLE001 (raised again, unchanged, in the consumer: never leave it waiting)
            queues[w].put(_Raised(e))
        finally:
            if source is not None and hasattr(source, "close"):
                source.close()

    threads = [threading.Thread(target=work, args=(w,), name=f"zerograph-prefetch-{w}", daemon=True) for w in range(workers)]
    for th in threads:
        th.start()
    try:
        k = 0
        while True:
            w = k % workers
            item = _take(queues[w], threads[w], w)
            if item is _END:
                return
            slots[w].release()
            if isinstance(item, _Raised):
                raise item.error
            yield item
            k += 1
    finally:
        stop.set()
        deadline = time.monotonic() + CLOSE_WAIT_S
        for th in threads:  # bounded: a worker inside a long read is left to finish it (a daemon thread)
            th.join(max(0.0, deadline - time.monotonic()))


def store_batches(reader, b_in: int, b_out: int, n: int, seed: int, batch_size: int, start: int,
                  steps: int, worker: int = 0, workers: int = 1,
                  pin_memory: bool = False) -> Iterator[tuple[int, np.ndarray, torch.Tensor, torch.Tensor]]:
    """The batches of training steps ``start + worker, start + worker + workers, ...`` (below
    ``steps``; all of ``start .. steps-1`` by default) of a block: ``(step, idx, x, y)`` with
    ``idx`` the step's sequence indices (int64), ``x`` / ``y`` boundaries ``b_in`` / ``b_out``
    of those sequences (``[len(idx), seq_len, hidden]`` in the store's dtype, float32 / bfloat16 /
    float16, as :meth:`~zgcore.data.boundary_store.BoundaryReader.read` returns them: the consumer
    widens with ``.float()`` after copying them to its device); ``y`` is ``None`` when ``b_out``
    is (a store read for one array, as the top-k logit store's records). Step ``s`` is batch
    ``s % per_epoch`` of epoch ``s // per_epoch`` (:func:`zgcore.data.order.batch_walk`).

    ``reader``: a :class:`~zgcore.data.boundary_store.BoundaryReader`, or the store's folder (opened
    here, and closed at the end: what a worker does; with ``pin_memory`` the batches are read
    straight into page-locked memory). Raises as the reader's ``read``.
    """
    from zgcore.data.boundary_store import BoundaryReader
    from zgcore.data.order import batch_walk

    own = not isinstance(reader, BoundaryReader)
    r = BoundaryReader(reader, pin_memory=pin_memory) if own else reader
    try:
        for step, idx in batch_walk(n, seed, batch_size, start + worker, steps, workers):
            yield step, idx, r.read("train", b_in, idx), (r.read("train", b_out, idx) if b_out is not None else None)
    finally:
        if own:
            r.close()


def stored_batch_bytes(reader, batch_size: int, arrays: int) -> int:
    """Bytes of ``batch_size`` sequences of ``arrays`` boundaries as ``reader``'s store holds them
    (``seq_len x hidden_size x`` the stored dtype's width each; a boundary codec's: its bytes per sequence); 0 for a
    store whose manifest does not give those (a logit store)."""
    from zgcore.device import torch_dtype

    m = getattr(reader, "manifest", {}) or {}
    if "seq_len" not in m or "hidden_size" not in m:
        return 0
    if getattr(reader, "codec", None) is not None:
        return int(batch_size) * int(arrays) * reader.codec.sequence_bytes
    width = torch_dtype(str(m.get("dtype", "float32"))).itemsize
    return int(batch_size) * int(arrays) * int(m["seq_len"]) * int(m["hidden_size"]) * width


def block_batches(reader, b_in: int, b_out: int, n: int, seed: int, batch_size: int, start: int, steps: int,
                  ahead: int, pin_memory: bool = False, workers: int | str = 1,
                  mode: str = "thread") -> Iterator[tuple[int, np.ndarray, torch.Tensor, torch.Tensor]]:
    """:func:`store_batches` of ``reader``, read ``ahead`` batches ahead by each of ``workers``
    worker threads or processes (``mode``) that open the store themselves (:func:`prefetch`), or
    in this thread with ``ahead`` = 0. ``"auto"`` for either: :func:`resolve_feed` of the batch's
    stored bytes, with ``pin_memory`` standing for an accelerator. A format-3 store is always read
    ahead by processes (h5py holds the GIL through each of its Fletcher32-filtered reads)."""
    if ahead <= 0:
        return store_batches(reader, b_in, b_out, n, seed, batch_size, start, steps)
    mode, workers = resolve_feed(mode, workers, stored_batch_bytes(reader, batch_size, 1 if b_out is None else 2),
                                 pin_memory)
    if mode == "thread" and reader.version < 4:  # format 3: h5py holds the GIL through each read
        mode = "process"
    # a worker thread's reader fills page-locked memory itself (no second copy); a worker process
    # must not touch CUDA, so there a thread of this process pins what the workers hand over
    in_reader = pin_memory and mode == "thread"
    return prefetch(partial(store_batches, str(reader.root), b_in, b_out, n, seed, batch_size, start, steps,
                            pin_memory=in_reader), ahead, pin_memory and not in_reader, workers, mode)

