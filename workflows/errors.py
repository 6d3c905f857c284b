"""Errors a user can act on, raised while a task runs, as one ``error:`` line.

Luigi's worker logs every exception a task raises with its traceback (``luigi-interface``,
``logger.exception``). For the errors whose message already says what is wrong and where — bad
input found only while reading it (:class:`zgcore.config.experiment.ConfigError`, e.g. a corpus file that
stops being UTF-8 after its first 64 KiB) and damaged stored data (a boundary shard, the token
store, a finished task's output: :class:`tasks.base.DamagedOutputError`) and a full disk or quota
(:class:`zgcore.atomic.NoSpaceError`) — a log filter replaces that record by the stderr line
``error: <task>: <message>`` without the traceback;
``ZG_TRACEBACK=1`` keeps it. The task still fails (Luigi's summary and exit code are unchanged). A full disk
is said once: the worker then starts no further task (every write would fail the same way).
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys

from .experiment import TRACEBACK_ENV


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions whose message says what to fix: imported when a task failed (the library is
    loaded by then), so that importing :mod:`workflows` loads no torch."""
    from tasks.base import DamagedOutputError
    from zgcore.atomic import NoSpaceError
    from zgcore.checks import ConfigError
    from zgcore.data.boundary_store import BoundaryStoreError
    from zgcore.data.corpus import TokenStoreError
    from zgcore.data.feed import PrefetchError

    return ConfigError, BoundaryStoreError, TokenStoreError, DamagedOutputError, PrefetchError, NoSpaceError


class OneLineUserErrors(logging.Filter):
    """A filter for the ``luigi-interface`` logger: a failure record whose exception is one of
    :func:`user_errors` is replaced by ``error: <task family> <label>: <message>`` on stderr, with
    no traceback, unless ``ZG_TRACEBACK=1``."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and isinstance(exc, user_errors()) and os.environ.get(TRACEBACK_ENV, "") in ("", "0"):
            task = record.args[-1] if isinstance(record.args, tuple) and record.args else None
            from tasks.base import ZGTask

            name = task.title() if isinstance(task, ZGTask) else str(task or "task")
            if not _out_of_space(exc):
                print(f"error: {name}: {exc} ({TRACEBACK_ENV}=1 shows the traceback)", file=sys.stderr, flush=True)
            return False
        return True


_NO_SPACE_SAID: list[bool] = []


def _out_of_space(exc: BaseException) -> bool:
    """For a :class:`zgcore.atomic.NoSpaceError` after the first one this process printed: ``True``
    (say nothing more: every later write fails the same way). For the first: ``False``, and the
    ``luigi`` command's worker is told to start no further task (Luigi's SIGUSR1, "phase out"), so
    the run ends with its one line once what is running stops."""
    from zgcore.atomic import NoSpaceError

    if not isinstance(exc, NoSpaceError):
        return False
    if _NO_SPACE_SAID:
        return True
    _NO_SPACE_SAID.append(True)
    from .ending import _MAIN_PID

    if callable(signal.getsignal(signal.SIGUSR1)):  # a Luigi worker's handler (never the default: it kills)
        with contextlib.suppress(OSError, AttributeError):
            os.kill(_MAIN_PID, signal.SIGUSR1)
    return False


def install() -> None:
    """Add :class:`OneLineUserErrors` to Luigi's ``luigi-interface`` logger (once)."""
    log = logging.getLogger("luigi-interface")
    if not any(isinstance(f, OneLineUserErrors) for f in log.filters):
        log.addFilter(OneLineUserErrors())
