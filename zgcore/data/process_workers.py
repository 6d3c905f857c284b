"""Prefetch worker processes (``train.prefetch_mode = "process"``, and what ``"auto"`` picks for
an accelerator's batches of 12 MiB and more): each worker reads
its share of the batches in its own interpreter and lends them to the training process in
shared-memory buffers that it reuses, so that the training thread's cost per batch is one small
message (figures: ``bench/data_feed.py``, docs/performance.md).

A worker's :class:`~zgcore.data.boundary_store.BoundaryReader` reads straight into the buffer it
lends (:func:`~zgcore.data.boundary_store.memory.set_allocator`); any other tensor of an item is
copied in. A buffer is sent once (its file descriptor, by torch's sharing), then named by number;
the training process gives it back once nothing refers to it (no Python reference, view or
tensor saved for backward: :func:`~zgcore.data.boundary_store.memory.unshared`), so an item is
never overwritten under its consumer. A batch is lent, not given: one sent on to a third process
must be sent as a copy (``.clone()``), since nothing here can see that process's references.
"""
from __future__ import annotations

import time
from typing import TypeVar
from collections.abc import Callable, Iterator

import torch

from zgcore.data.boundary_store.memory import set_allocator, unshared
from zgcore.data.handover import CLOSE_WAIT_S, _context, _Raised, same_kind, worker_gone

T = TypeVar("T")


class _ConsumerGone(Exception):
    """In a worker process: its pipe to the consumer is closed or broken (the consumer closed or died)."""


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
    """``item`` with the tensors at the positions of ``tensors`` replaced (by buffers or markers),
    of the item's own type (a named tuple stays one)."""
    if not isinstance(item, tuple):
        return tensors.get(0, item)
    values = [tensors.get(i, x) for i, x in enumerate(item)]
    return same_kind(item, values)


class _SharedBuffers:
    """A worker process's shared-memory buffers, each lent to the consumer and given back by number.
    The worker's :class:`~zgcore.data.boundary_store.BoundaryReader` reads straight into them
    (:func:`zgcore.data.boundary_store.memory.set_allocator`), so a batch crosses with no copy. A
    buffer is taken only when it is free: given back by the consumer, and referred to by nothing in
    this process either (a source that kept it; :func:`~zgcore.data.boundary_store.memory.unshared`)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.bufs: dict[int, torch.Tensor] = {}
        self.free: set[int] = set()  # given back by the consumer
        self.sent: set[int] = set()  # the consumer has this number's current tensor
        self.taken: list[int] = []  # taken for the item being produced

    def take(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor | None:
        """A free buffer of this shape and dtype, else a new one (in place of a free buffer of another
        shape once ``limit`` buffers exist); None when every buffer is busy."""
        spare = None
        for i in sorted(self.free):
            if not unshared(self.bufs[i], sent=True):
                continue  # still held here (a source kept it): not yet
            if tuple(self.bufs[i].shape) == tuple(shape) and self.bufs[i].dtype == dtype:
                return self._lend(i)
            spare = i if spare is None else spare
        if len(self.bufs) < self.limit:
            i = len(self.bufs)
        elif spare is not None:  # a shape no longer asked for makes way (the consumer gets the new tensor)
            i = spare
            self.sent.discard(i)
        else:
            return None
        self.bufs[i] = torch.empty(shape, dtype=dtype).share_memory_()
        return self._lend(i)

    def _lend(self, i: int) -> torch.Tensor:
        self.free.discard(i)
        self.taken.append(i)
        return self.bufs[i]

    def ident(self, t: torch.Tensor) -> int | None:
        """The number of buffer ``t`` (the very tensor) taken for the item being produced, or None."""
        for i in self.taken:
            if self.bufs[i] is t:
                return i
        return None


def _dumps(msg) -> bytes:
    """``msg`` pickled here, in the worker (torch's reductions: a shared tensor's file descriptor
    is passed), so that a message that cannot be pickled raises in the worker, where it is caught
    and sent as an error, instead of leaving the consumer waiting for it."""
    import io

    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(msg)
    return buf.getvalue()


def _error_message(e: BaseException) -> bytes:
    """``e`` for the consumer: itself where it pickles and unpickles, else a RuntimeError naming its
    type and message."""
    import pickle

    try:
        pickle.loads(pickle.dumps(e))  # by value: a trial of torch's reduction would use up a shared tensor's descriptor
        return _dumps(("item", _Raised(e)))
    except Exception:  # noqa: BLE001 (any failure: the consumer still gets one line naming the error)
        return _dumps(("item", _Raised(RuntimeError(f"{type(e).__name__}: {e}"))))


def _process_worker(make_source, w: int, workers: int, ahead: int, slots: int, conn, stop, parent: int,
                    others=()) -> None:
    """Worker process ``w``: produce ``make_source(w, workers)``'s items on its end ``conn`` of a
    duplex pipe, at most ``ahead`` beyond what the consumer took (the consumer's message for each
    item it takes is a credit: the numbers of the buffers it gives back), with their tensors in
    shared-memory buffers: a boundary store's reader reads straight into them, any other tensor (or
    one the item holds twice) is copied in. A buffer is sent once, when first made; afterwards only
    its number travels. A tensor with no buffer free (a consumer keeping old items) is sent as is,
    through torch's shared memory. Ends when ``stop`` is set, the consumer closed its end, or the
    consumer's process ``parent`` is gone (killed: nothing else would tell it). ``others``: every
    other pipe end this process inherited by ``fork`` (the consumer's end of its own pipe among
    them), closed first, so that the consumer's closing or death reads here as a broken pipe even
    in the middle of a send."""
    import os
    import pickle
    import signal

    for c in others:
        c.close()

    def send(data: bytes) -> None:
        try:
            conn.send_bytes(data)
        except OSError as e:
            raise _ConsumerGone from e

    def receive() -> list[int]:
        try:
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError) as e:
            raise _ConsumerGone from e

    def gone() -> bool:
        return stop.is_set() or os.getppid() != parent

    # Ctrl-C in a terminal reaches every process of the group: the training process stops its
    # workers itself (one line, exit 130), so a worker must not print a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by the parent while it forked
    torch.set_num_threads(1)  # as DataLoader's workers: a forked OpenMP pool must not be used, nor oversubscribe
    pool = _SharedBuffers(BUFFERS_PER_ITEM * slots)
    set_allocator(pool.take)
    source, credit = None, ahead
    try:
        source = make_source(w, workers)
        while True:
            while credit == 0 or conn.poll(0):  # take what the consumer sent; wait while no credit is left
                if not conn.poll(0.05):
                    if gone():
                        return
                    continue
                pool.free.update(receive())  # one credit, with the buffers given back
                credit += 1
            if gone():
                return
            item = t = b = None  # the last item's tensors: no reference left here while buffers are taken
            pool.taken = []
            try:
                item = next(source)
            except StopIteration:
                send(_dumps(("end",)))
                break
            credit -= 1
            places, new, used = {}, {}, set()
            b = None
            for pos, t in _tensors(item):
                i = pool.ident(t)
                if i is None or i in used:  # not read into a buffer for this item, or held twice: copy it in
                    b = pool.take(tuple(t.shape), t.dtype)
                    if b is None:
                        continue  # sent by value
                    b.copy_(t)
                    i = pool.ident(b)
                used.add(i)
                places[pos] = i
            for i in set(pool.taken) - used:  # taken for this item but not lent after all
                pool.free.add(i)
            if not places:  # nothing lent: the item as it is
                send(_dumps(("item", item)))
                continue
            for i in places.values():
                if i not in pool.sent:
                    new[i] = pool.bufs[i]
                    pool.sent.add(i)
            send(_dumps(("bufs", _with(item, {pos: _InBuffer(i) for pos, i in places.items()}), new)))
    except _ConsumerGone:
        return  # the consumer closed its end: nobody to tell (a source's own pipe error is the source's, below)
    except BaseException as e:  # noqa: BLE001 (raised again, unchanged, in the consumer: never leave it waiting)
        try:
            send(_error_message(e))
        except _ConsumerGone:
            return
    finally:
        set_allocator(None)
        if source is not None and hasattr(source, "close"):
            source.close()
    # a buffer's file descriptor is fetched from this process when the consumer unpickles its message:
    # stay until the consumer is done
    while not stop.wait(0.5) and not gone():
        pass


def _receive(conn, proc, w: int) -> bytes:
    """The next message of worker process ``w`` on the consumer's end ``conn`` of its pipe; a worker
    that ended without handing anything over must not hang the consumer.

    Raises:
        PrefetchError: the worker is gone and sent nothing more."""
    while True:
        if conn.poll(1.0):
            try:
                return conn.recv_bytes()
            except (EOFError, OSError):  # closed, or reset by a worker that died with credits unread
                break
        if not proc.is_alive() and not conn.poll(0):
            break
    raise worker_gone(w)


def processes(make_source: Callable[[int, int], Iterator[T]], ahead: int, workers: int) -> Iterator[T]:
    """:func:`~zgcore.data.feed.prefetch` with worker processes: at most ``ahead`` items in flight per
    worker, and each item's tensors handed over in reused shared-memory buffers
    (:class:`_SharedBuffers`, at most ``BUFFERS_PER_ITEM * (ahead + SLOT_SLACK)`` per worker; a
    worker's boundary reader reads into them, so a batch is copied from the page cache once, as by
    a thread). A buffer goes back to its worker once nothing in this process refers to it any more
    (the test of the boundary reader's pool). Each worker has one duplex pipe: per batch the
    training thread receives one small message and sends one back (a credit and the buffers it
    gives back), never a file descriptor per tensor nor a fresh mapping (``bench/data_feed.py``).
    Closing stops the workers (at most ``CLOSE_WAIT_S``, then terminated).

    Raises:
        PrefetchError: a worker process ended without handing anything over."""
    import os
    import pickle
    import signal

    import torch.multiprocessing as tmp

    ctx = tmp.get_context(_context())
    stop = ctx.Event()
    slots = ahead + SLOT_SLACK
    pipes = [ctx.Pipe(duplex=True) for _ in range(workers)]
    conns = [mine for mine, _ in pipes]
    ends = [c for pair in pipes for c in pair]
    forked = ctx.get_start_method() == "fork"  # a forked worker holds a copy of every end made so far
    procs = [ctx.Process(target=_process_worker, args=(make_source, w, workers, ahead, slots, pipes[w][1], stop,
                                                       os.getpid(), [c for c in ends if c is not pipes[w][1]] if forked else []),
                         name=f"zerograph-prefetch-{w}", daemon=True) for w in range(workers)]
    # a worker is born with SIGINT blocked (a pending one is then dropped by its SIG_IGN), so that a
    # Ctrl-C between its fork and its first line cannot print a traceback; this process's own SIGINT
    # is held for those milliseconds, not lost
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for p in procs:
            p.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    for _, theirs in pipes:
        theirs.close()  # only the worker holds its end: its death reads as the end of the pipe here
    bufs: list[dict[int, torch.Tensor]] = [{} for _ in range(workers)]
    lent: list[tuple[int, int]] = []  # (worker, buffer) handed out, not yet given back
    freed: list[list[int]] = [[] for _ in range(workers)]  # given back, to go with that worker's next credit

    def give_back() -> None:
        for w, i in list(lent):
            if unshared(bufs[w][i], sent=True):
                freed[w].append(i)
                lent.remove((w, i))

    try:
        k = 0
        while True:
            w = k % workers
            give_back()
            msg = pickle.loads(_receive(conns[w], procs[w], w))
            if msg[0] == "end":
                return
            try:
                conns[w].send_bytes(pickle.dumps(freed[w]))  # the worker's credit for this item
            except OSError:
                pass  # the worker died: this item is whole (its buffers are mapped here); the next receive says so
            freed[w] = []
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
            item = msg = new = None  # the consumer's references are the ones that count
            k += 1
    finally:
        stop.set()
        for c in conns:
            c.close()  # a worker blocked sending a large item gets a broken pipe, then closes its source
        deadline = time.monotonic() + CLOSE_WAIT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(1.0)
