"""Prefetch worker processes (``train.prefetch_mode = "process"``, the default): each worker reads
its share of the batches in its own interpreter and lends them to the training process in
shared-memory buffers that it reuses, so that the training thread's cost per batch is one small
message (``bench/data_feed.py``: 1.2-3.8% of a step against 3.5-9.2% for worker threads).

A worker's :class:`~zgcore.data.boundary_store.BoundaryReader` reads straight into the buffer it
lends (:func:`~zgcore.data.boundary_store.memory.set_allocator`); any other tensor of an item is
copied in. A buffer is sent once (its file descriptor, by torch's sharing), then named by number;
the training process gives it back once nothing refers to it (no Python reference, view or
tensor saved for backward: :func:`~zgcore.data.boundary_store.memory.unshared`), so an item is
never overwritten under its consumer.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator, TypeVar

import torch

from zgcore.data.boundary_store.memory import set_allocator, unshared
from zgcore.data.handover import CLOSE_WAIT_S, _context, _Raised, _take

T = TypeVar("T")


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


    def gone() -> bool:
        return stop.is_set() or os.getppid() != parent

    # Ctrl-C in a terminal reaches every process of the group: the training process stops its
    # workers itself (one line, exit 130), so a worker must not print a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by the parent while it forked
    torch.set_num_threads(1)  # as DataLoader's workers: a forked OpenMP pool must not be used, nor oversubscribe
    pool = _SharedBuffers(BUFFERS_PER_ITEM * slots)
    set_allocator(pool.take)
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
        set_allocator(None)
        if source is not None and hasattr(source, "close"):
            source.close()
    # a buffer's file descriptor is fetched from this process when the consumer unpickles its message:
    # stay until the consumer is done
    while not stop.wait(0.5) and not gone():
        pass


def processes(make_source: Callable[[int, int], Iterator[T]], ahead: int, workers: int) -> Iterator[T]:
    """:func:`~zgcore.data.feed.prefetch` with worker processes: the in-flight bound of :func:`~zgcore.data.feed._threaded` (a credit per
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
    import signal

    # a worker is born with SIGINT blocked (a pending one is then dropped by its SIG_IGN), so that a
    # Ctrl-C between its fork and its first line cannot print a traceback; this process's own SIGINT
    # is held for those milliseconds, not lost
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for p in procs:
            p.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    bufs: list[dict[int, torch.Tensor]] = [{} for _ in range(workers)]
    lent: list[tuple[int, int]] = []  # (worker, buffer) handed out, not yet given back

    def give_back() -> None:
        for w, i in list(lent):
            if unshared(bufs[w][i], sent=True):
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
