"""The input pipeline of cached training: batches are read and checked ahead
of the training step by background workers, at most ``ahead`` batches in flight per worker, in the
same order and with the same bytes as a synchronous read.

Two kinds of worker (``train.prefetch_mode``):

* ``"process"`` (default): worker processes (``fork`` where there is one), each reading every
  ``workers``-th batch and checking it in its own interpreter, so its Python never holds the
  training thread's GIL. A batch crosses in one of a few shared-memory buffers the worker reuses
  (:func:`_processes`): the training thread receives one small message per batch and never maps a
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
checking one batch ahead cost the training thread 1.3-3.4% of a step with two worker processes and
5.6-7.3% with two worker threads (3.5-4.9% with the threads kept off the training thread's core,
``--pin``); ``bench/README.md``.

Either way an error in a worker (a damaged shard: :class:`~zgcore.data.boundary_store.BoundaryStoreError`)
is handed over as a value and raised in the consumer with its own type and message, at the batch
that needed it.
"""
from __future__ import annotations

import multiprocessing
import time
from functools import partial
from typing import Callable, Iterator, TypeVar

import numpy as np
import torch

T = TypeVar("T")


class _Raised:
    """An exception raised by the source in the worker, carried to the consumer as a value."""

    def __init__(self, error: BaseException):
        self.error = error


def _context() -> str:
    """``fork`` where there is one (the worker starts in milliseconds and inherits the source),
    else ``spawn`` (``make_source`` must then be picklable)."""
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


MODES = ("thread", "process")


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
        yield from _threaded(lambda w, n: _processes(make_source, int(ahead), max(1, int(workers))), 1, True, 1)
        return
    yield from _processes(make_source, int(ahead), max(1, int(workers)))


_END = object()
# Closing the threaded prefetch waits at most this long for its workers: a worker in the middle of a
# long read is a daemon thread, left to finish that read on its own (its items are dropped).
CLOSE_WAIT_S = 2.0


class PrefetchError(RuntimeError):
    """A prefetch worker ended without handing over an item, an end or an error (it cannot happen
    through Python code; the interpreter or a C extension stopped the thread). One line: rerun (a
    training task resumes from its last checkpoint), or read synchronously with ``train.prefetch=0``."""


def _take(q, worker, w: int):
    """The next message of worker ``w`` (a thread or a process) from its queue ``q``; a worker that
    ended without handing anything over must not hang the consumer.

    Raises:
        PrefetchError: the worker is gone and its queue is empty."""
    import queue

    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            if not worker.is_alive() and q.empty():
                raise PrefetchError(f"prefetch worker {w} ended without an item, an end or an error; rerun "
                                    "(training resumes from its last checkpoint) or set train.prefetch=0 "
                                    "to read synchronously") from None


def _pinned(item):
    """``item`` (a tensor, or a tuple of tensors and other values) with its tensors in page-locked memory."""
    if isinstance(item, torch.Tensor):
        return item if item.is_pinned() else item.pin_memory()
    if isinstance(item, tuple):
        return tuple(_pinned(x) for x in item)
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


class _InBuffer:
    """In a message from a worker process: the item's tensor at this place is shared buffer ``ident``."""

    def __init__(self, ident: int):
        self.ident = ident


# Buffers per worker process beyond its ``ahead`` items in flight: the consumer still holds the item
# it works on (and the one before, until its loop variables are rebound) when it asks for the next.
SLOT_SLACK = 3
# at most this many shared buffers per worker and item in flight (an item of a block: x and y)
BUFFERS_PER_ITEM = 4


def _tensors(item) -> list[tuple[int, torch.Tensor]]:
    """``(position, tensor)`` for each tensor of an item (the item itself, or a tuple's elements)."""
    if isinstance(item, torch.Tensor):
        return [(0, item)]
    if isinstance(item, tuple):
        return [(i, x) for i, x in enumerate(item) if isinstance(x, torch.Tensor)]
    return []


def _with(item, tensors: dict):
    """``item`` with the tensors at the positions of ``tensors`` replaced (by buffers or markers)."""
    if not isinstance(item, tuple):
        return tensors[0]
    return tuple(tensors.get(i, x) for i, x in enumerate(item))


class _SharedBuffers:
    """A worker process's shared-memory buffers, each lent to the consumer and given back by number.
    The worker's :class:`~zgcore.data.boundary_store.BoundaryReader` reads straight into them
    (:func:`zgcore.data.boundary_store.reader.set_allocator`), so a batch crosses with no copy."""

    def __init__(self, limit: int):
        self.limit = limit
        self.bufs: dict[int, torch.Tensor] = {}
        self.free: set[int] = set()
        self.sent: set[int] = set()

    def take(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor | None:
        """A free buffer of this shape and dtype (made if there is none and the limit allows), now
        busy until given back; None when every buffer is busy."""
        for i in self.free:
            b = self.bufs[i]
            if tuple(b.shape) == tuple(shape) and b.dtype == dtype:
                self.free.discard(i)
                return b
        if len(self.bufs) >= self.limit:
            return None
        b = torch.empty(shape, dtype=dtype).share_memory_()
        self.bufs[len(self.bufs)] = b
        return b

    def ident(self, t: torch.Tensor) -> int | None:
        """The number of buffer ``t`` (the very tensor), or None if it is not one of these."""
        for i, b in self.bufs.items():
            if b is t:
                return i
        return None


def _process_worker(make_source, w: int, workers: int, slots: int, credits, out_q, free_q, stop, parent: int) -> None:
    """Worker process ``w``: produce ``make_source(w, workers)``'s items, each after taking a credit
    (at most ``ahead`` beyond what the consumer took), with its tensors in shared-memory buffers
    the consumer gives back once it no longer refers to them: a boundary store's reader reads
    straight into them, any other tensor is copied in. A buffer is sent once, when first made;
    afterwards only its number travels. With every buffer busy (a consumer keeping old items), the
    item is sent as is, through torch's shared memory. Ends when ``stop`` is set or the consumer's
    process ``parent`` is gone (killed: nothing else would tell it)."""
    import os
    import signal

    from zgcore.data.boundary_store import reader as boundary_reader

    def gone() -> bool:
        return stop.is_set() or os.getppid() != parent

    # Ctrl-C in a terminal reaches every process of the group: the training process stops its
    # workers itself (one line, exit 130), so a worker must not print a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)  # as DataLoader's workers: a forked OpenMP pool must not be used, nor oversubscribe
    pool = _SharedBuffers(BUFFERS_PER_ITEM * slots)
    boundary_reader.set_allocator(pool.take)
    source = None
    try:
        source = make_source(w, workers)
        while True:
            while not credits.acquire(timeout=0.05):
                if gone():
                    return
            if gone():
                return
            try:
                item = next(source)
            except StopIteration:
                out_q.put(("end",))
                break
            while not free_q.empty():
                pool.free.add(free_q.get())
            places, new, by_value = {}, {}, False
            for pos, t in _tensors(item):
                i = pool.ident(t)
                if i is None:
                    b = pool.take(tuple(t.shape), t.dtype)
                    if b is None:
                        by_value = True
                        break
                    b.copy_(t)
                    i = pool.ident(b)
                places[pos] = i
            if by_value or not places:
                out_q.put(("item", item))  # a buffer in it is sent by value too, and stays busy: never reused
                continue
            for i in places.values():
                if i not in pool.sent:
                    new[i] = pool.bufs[i]
                    pool.sent.add(i)
            out_q.put(("bufs", _with(item, {pos: _InBuffer(i) for pos, i in places.items()}), new))
    except BaseException as e:  # noqa: BLE001 (raised again, unchanged, in the consumer: never leave it waiting)
        out_q.put(("item", _Raised(e)))
    finally:
        boundary_reader.set_allocator(None)
        if source is not None and hasattr(source, "close"):
            source.close()
    # a buffer's file descriptor is fetched from this process when the consumer unpickles its message:
    # stay until the consumer is done
    while not stop.wait(0.5) and not gone():
        pass


def _processes(make_source: Callable[[int, int], Iterator[T]], ahead: int, workers: int) -> Iterator[T]:
    """:func:`prefetch` with worker processes: the in-flight bound of :func:`_threaded` (a credit per
    item, given back when the consumer takes it), and each item's tensors handed over in reused
    shared-memory buffers (:class:`_SharedBuffers`, at most ``BUFFERS_PER_ITEM * (ahead +
    SLOT_SLACK)`` per worker; a worker's boundary reader reads into them, so a batch is copied
    from the page cache once, as by a thread). A buffer goes back to its worker once
    nothing in this process refers to it any more (the test of the boundary reader's pool): the
    training thread's cost per batch is one small message, never a file descriptor per tensor nor a
    fresh mapping (``bench/data_feed.py``). Closing stops the workers (at most ``CLOSE_WAIT_S``,
    then terminated).

    Raises:
        PrefetchError: a worker process ended without handing anything over."""
    from zgcore.data.boundary_store.reader import _unshared
    import torch.multiprocessing as tmp

    ctx = tmp.get_context(_context())
    stop = ctx.Event()
    slots = ahead + SLOT_SLACK
    credits = [ctx.Semaphore(ahead) for _ in range(workers)]
    outs = [ctx.Queue() for _ in range(workers)]
    frees = [ctx.SimpleQueue() for _ in range(workers)]
    import os

    procs = [ctx.Process(target=_process_worker, args=(make_source, w, workers, slots, credits[w], outs[w], frees[w], stop,
                                                       os.getpid()),
                         name=f"zerograph-prefetch-{w}", daemon=True) for w in range(workers)]
    for p in procs:
        p.start()
    bufs: list[dict[int, torch.Tensor]] = [{} for _ in range(workers)]
    lent: list[tuple[int, int]] = []  # (worker, buffer) handed out, not yet given back

    def give_back() -> None:
        for w, i in list(lent):
            if _unshared(bufs[w][i], sent=True):
                frees[w].put(i)
                lent.remove((w, i))

    try:
        k = 0
        while True:
            w = k % workers
            give_back()
            msg = _take(outs[w], procs[w], w)
            if msg[0] == "end":
                return
            credits[w].release()
            if msg[0] == "bufs":
                _, item, new = msg
                bufs[w].update(new)
                marks = [(i, x) for i, x in enumerate(item if isinstance(item, tuple) else [item]) if isinstance(x, _InBuffer)]
                lent.extend((w, x.ident) for _, x in marks)
                item = _with(item, {i: bufs[w][x.ident] for i, x in marks})
            else:
                item = msg[1]
            if isinstance(item, _Raised):
                raise item.error
            yield item
            k += 1
    finally:
        stop.set()
        deadline = time.monotonic() + CLOSE_WAIT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(1.0)
        for q in outs:
            q.cancel_join_thread()
            q.close()


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
    ``s % per_epoch`` of epoch ``s // per_epoch`` in :func:`zgcore.training.loop.data_order`.

    ``reader``: a :class:`~zgcore.data.boundary_store.BoundaryReader`, or the store's folder (opened
    here, and closed at the end: what a worker does; with ``pin_memory`` the batches are read
    straight into page-locked memory). Raises as the reader's ``read``.
    """
    from zgcore.data.boundary_store import BoundaryReader
    from zgcore.data.order import data_order

    own = not isinstance(reader, BoundaryReader)
    r = BoundaryReader(reader, pin_memory=pin_memory) if own else reader
    per_epoch = (n + batch_size - 1) // batch_size
    epoch, order = -1, None
    try:
        for step in range(start + worker, steps, workers):
            e, k = divmod(step, per_epoch)
            if e != epoch:
                epoch, order = e, data_order(n, seed, e)
            idx = order[k * batch_size: (k + 1) * batch_size]
            yield step, idx, r.read("train", b_in, idx), (r.read("train", b_out, idx) if b_out is not None else None)
    finally:
        if own:
            r.close()


def block_batches(reader, b_in: int, b_out: int, n: int, seed: int, batch_size: int, start: int, steps: int,
                  ahead: int, pin_memory: bool = False, workers: int = 1,
                  mode: str = "thread") -> Iterator[tuple[int, np.ndarray, torch.Tensor, torch.Tensor]]:
    """:func:`store_batches` of ``reader``, read ``ahead`` batches ahead by each of ``workers``
    worker threads or processes (``mode``) that open the store themselves (:func:`prefetch`), or
    in this thread with ``ahead`` = 0. A format-3 store is always read ahead by processes (h5py
    holds the GIL through each of its Fletcher32-filtered reads)."""
    if ahead <= 0:
        return store_batches(reader, b_in, b_out, n, seed, batch_size, start, steps)
    if mode == "thread" and reader.version < 4:  # format 3: h5py holds the GIL through each read
        mode = "process"
    # a worker thread's reader fills page-locked memory itself (no second copy); a worker process
    # must not touch CUDA, so there a thread of this process pins what the workers hand over
    in_reader = pin_memory and mode == "thread"
    return prefetch(partial(store_batches, str(reader.root), b_in, b_out, n, seed, batch_size, start, steps,
                            pin_memory=in_reader), ahead, pin_memory and not in_reader, workers, mode)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: an asynchronous copy (``non_blocking``) from page-locked memory to a
    CUDA device, a plain ``.to`` otherwise. The bytes and dtype are those of ``t`` either way
    (widen 16-bit boundaries with ``.float()`` afterwards, on the device)."""
    return t.to(device, non_blocking=device.type == "cuda" and t.is_pinned())
