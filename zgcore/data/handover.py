"""What prefetch workers (threads or processes) hand the consumer besides items: a source's error
carried as a value, and the consumer's wait for a worker thread that may have died."""
from __future__ import annotations

import multiprocessing


class _Raised:
    """An exception raised by the source in the worker, carried to the consumer as a value."""

    def __init__(self, error: BaseException):
        self.error = error


def _context() -> str:
    """``fork`` where there is one (the worker starts in milliseconds and inherits the source),
    else ``spawn`` (``make_source`` must then be picklable)."""
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


# Closing the threaded prefetch waits at most this long for its workers: a worker in the middle of a
# long read is a daemon thread, left to finish that read on its own (its items are dropped).
CLOSE_WAIT_S = 2.0


class PrefetchError(RuntimeError):
    """A prefetch worker ended without handing over an item, an end or an error (it cannot happen
    through Python code; the interpreter or a C extension stopped the thread). One line: rerun (a
    training task resumes from its last checkpoint), or read synchronously with ``train.prefetch=0``."""


def _take(q, worker, w: int):
    """The next message of worker thread ``w`` from its queue ``q``; a worker that ended without
    handing anything over must not hang the consumer (worker processes: ``process_workers._receive``).

    Raises:
        PrefetchError: the worker is gone and its queue is empty."""
    import queue

    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            if not worker.is_alive() and q.empty():
                raise worker_gone(w) from None


def worker_gone(w: int) -> PrefetchError:
    """The one-line error for worker ``w`` (a thread or a process) that ended without handing over
    an item, an end or an error."""
    return PrefetchError(f"prefetch worker {w} ended without an item, an end or an error; rerun "
                         "(training resumes from its last checkpoint) or set train.prefetch=0 "
                         "to read synchronously")


def same_kind(item: tuple, values) -> tuple:
    """``values`` as a tuple of ``item``'s own type (a named tuple stays one), for a worker that
    rebuilds an item with some elements replaced."""
    return type(item)(*values) if hasattr(item, "_fields") else tuple(values)
