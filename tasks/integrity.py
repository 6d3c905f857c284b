"""What a task's output checks cost and how their failures read: the line between metadata, which
:meth:`tasks.base.ZGTask.complete` hashes, and bulk files, which every reader hashes in full
before it starts (:meth:`tasks.base.ZGTask.check_inputs`); the errors of damaged and unreadable
outputs, and the log filter that gives an unreadable one as one line."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import os
from pathlib import Path
from collections.abc import Iterator

# A recorded file up to this size is metadata (records, metrics, reports): complete() compares its
# SHA-256. A larger one (weights, stores, checkpoints) is bulk: complete() compares its size, and its
# SHA-256 is compared, in full and uncached, by every task that reads it, before its run starts
# (ZGTask.check_inputs), by a consumer loading it (ZGTask.checked) and by `zerograph verify`. So
# complete() reads a bounded number of bytes whatever the size of the output.
METADATA_BYTES = 64 * 1024


class DamagedOutputError(RuntimeError):
    """A finished task's output file whose bytes are not those recorded when it was written
    (missing, cut short, or changed); the message names the file and where the folder was moved."""


class OutputUnreadableError(RuntimeError):
    """The file system could not read a finished task's output while :meth:`tasks.base.ZGTask.complete` checked
    it (an ``OSError`` with an errno: EIO, ESTALE, EACCES, ...). Not damage: nothing is moved. Luigi
    logs it as one line (:class:`OneLineCompleteErrors`), naming the task, the file and the error."""


class OneLineCompleteErrors(logging.Filter):
    """A filter for the ``luigi-interface`` logger: Luigi's "error in complete() method" warning,
    whose message carries the whole traceback, becomes one line when the error is an
    :class:`OutputUnreadableError` (``ZG_TRACEBACK=1`` keeps the traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        name = OutputUnreadableError.__name__
        if "error in complete() method" in msg and f"{name}: " in msg and os.environ.get("ZG_TRACEBACK", "") in ("", "0"):
            last = next(line for line in reversed(msg.splitlines()) if f"{name}: " in line)
            record.msg, record.args = "error: " + last.split(f"{name}: ", 1)[1] + " (ZG_TRACEBACK=1 shows the traceback)", ()
        return True


def _one_line_complete_errors() -> None:
    log = logging.getLogger("luigi-interface")
    if not any(isinstance(f, OneLineCompleteErrors) for f in log.filters):
        log.addFilter(OneLineCompleteErrors())


_one_line_complete_errors()


def _checking_inputs(run):
    """Wrap a family's ``run`` so that it runs alone (:func:`tasks.exclusive.alone`: one build of a
    task at a time across the processes sharing its outputs folder; one that another process finished
    meanwhile is not built again) and the bulk files of every output it reads are checked in full
    first (:meth:`ZGTask.check_inputs`); once per task object, also when ``run`` calls ``super().run()``."""
    from .exclusive import alone, alone_generator

    def body(self, *args, **kwargs):
        if not self.__dict__.get("_inputs_checked"):
            self.check_inputs()
            self._inputs_checked = True
        return run(self, *args, **kwargs)

    @functools.wraps(run)
    def checked_run(self, *args, **kwargs):
        if self.__dict__.get("_alone"):  # super().run() inside the run: already held
            return body(self, *args, **kwargs)
        if inspect.isgeneratorfunction(run):
            return alone_generator(self, body, args, kwargs)
        with alone(self) as done:
            return None if done else body(self, *args, **kwargs)
    checked_run.checks_inputs = True
    return checked_run


RECORD_DIGEST = "task.json.sha256"  # beside every task.json: the SHA-256 of its bytes


def write_record(folder: Path, text: str) -> None:
    """Write ``task.json`` (``text``) into ``folder`` and, beside it, the SHA-256 of its bytes
    (:data:`RECORD_DIGEST`): a changed byte of the record itself (a configuration, a size, a
    recorded SHA-256, a key) is damage like any other file's."""
    import hashlib

    (folder / "task.json").write_text(text)
    (folder / RECORD_DIGEST).write_text(hashlib.sha256((folder / "task.json").read_bytes()).hexdigest() + "\n")


def record_problem(folder: Path) -> str | None:
    """``None`` when ``folder``'s ``task.json`` has the bytes :func:`write_record` hashed (or has no
    digest beside it: written before records carried one), else what is wrong. Raises ``OSError``."""
    import hashlib

    side = folder / RECORD_DIGEST
    if not side.is_file():
        return None
    try:
        raw = (folder / "task.json").read_bytes()
    except FileNotFoundError:
        return "task.json is missing"
    if hashlib.sha256(raw).hexdigest() != side.read_text().strip():
        return f"task.json's bytes differ from the SHA-256 written beside it ({RECORD_DIGEST})"
    return None


_PASS: contextvars.ContextVar[dict[str, bool] | None] = contextvars.ContextVar("zg_completion_pass", default=None)


@contextlib.contextmanager
def completion_pass() -> Iterator[None]:
    """Within this block each task's :meth:`tasks.base.ZGTask.complete` is worked out once and then
    remembered, by task id: one consistent look at a graph's outputs (what ``zerograph status``
    and a sweep over a graph take), in time linear in the graph rather than in its paths. Use it
    only where nothing is built inside the block: a task that finishes within it still reads as
    it was first seen. Nested blocks share the outer one's memory."""
    if _PASS.get() is not None:
        yield
        return
    token = _PASS.set({})
    try:
        yield
    finally:
        _PASS.reset(token)


# tests only: a folder; while it is set, each family's first build SIGKILLs its own process once its
# files and record are written, before the rename (tests/test_contract_families.py kills every family so)
KILL_ENV = "ZG_KILL_EACH_FAMILY"


def kill_point(family: str) -> None:
    """Where :meth:`tasks.base.ZGTask.building` may be killed under :data:`KILL_ENV` (a no-op unset)."""
    where = os.environ.get(KILL_ENV)
    if where:
        try:
            (Path(where) / family).touch(exist_ok=False)  # O_EXCL: once per family, whichever process comes first
        except FileExistsError:
            return
        os.kill(os.getpid(), 9)  # SIGKILL
