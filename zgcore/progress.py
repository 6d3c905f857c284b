"""Progress for people and for log files: a tqdm bar on a terminal, a few plain lines elsewhere.

On a terminal (stderr is a tty) :func:`progress_bar` is a tqdm bar redrawn at most every
:data:`TERMINAL_INTERVAL_S` seconds. Anywhere else (a log file, a pipe, a Slurm job's output) a
redrawn bar would write one line per update: 681 KB for a 6,000-step run. There it is a
:class:`LogLines`: one line of the same figures (``done/total``, rate, elapsed, remaining, the
postfix such as the loss) each time another tenth of the total is done, but never two within
:data:`LOG_INTERVAL_S` seconds, and a last line at the end if the bar ran that long. So a bar writes
at most about 11 lines whatever its length, and a bar of a few seconds writes none.

``ZG_PROGRESS=bar`` or ``ZG_PROGRESS=lines`` forces one or the other; ``TQDM_DISABLE=1`` (tqdm's own
switch) silences both. :func:`quiet_library_bars`
turns off the bars Hugging Face draws itself ("Loading weights", "Writing model shards") where
ours are lines.
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

TERMINAL_INTERVAL_S = 3.0
LOG_INTERVAL_S = 30.0
LOG_FRACTION = 0.1


def on_terminal(stream: TextIO | None = None) -> bool:
    """Whether progress is drawn as a bar: ``ZG_PROGRESS`` (``bar`` / ``lines``) when set, else
    whether ``stream`` (default ``sys.stderr``) is a terminal."""
    forced = os.environ.get("ZG_PROGRESS", "").strip().lower()
    if forced in ("bar", "lines"):
        return forced == "bar"
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


class LogLines:
    """The part of tqdm's interface the library uses (``update``, ``set_postfix``, ``close``, context
    manager), writing plain lines instead of redrawing (see the module docstring).

    Args:
        total: units of work (steps, sequences, batches). desc: the line's prefix. unit: the unit's name.
        initial: units already done (a resumed run). interval_s: the least time between two lines.
        fraction: a line each time this share of ``total`` more is done. file: where lines go (stderr).
        unit_scale: counts with SI prefixes (``1.23GB``), as tqdm's ``unit_scale``.
    """

    def __init__(self, total: int, desc: str = "", unit: str = "it", initial: int = 0,
                 interval_s: float = LOG_INTERVAL_S, fraction: float = LOG_FRACTION, file: TextIO | None = None,
                 unit_scale: bool = False):
        self.total, self.desc, self.unit, self.n, self.initial = int(total), desc, unit, int(initial), int(initial)
        self.unit_scale = bool(unit_scale)
        self.interval_s, self.file, self.postfix = float(interval_s), file, ""
        self.step = max(1, int(self.total * fraction))
        self.next = self.n + self.step
        self.start = self.last = time.monotonic()
        self.lines = 0
        self.closed = False

    def line(self) -> str:
        """The current figures as tqdm formats them, without the bar."""
        return tqdm.format_meter(self.n, self.total, time.monotonic() - self.start, ncols=0, prefix=self.desc,
                                 unit=self.unit, postfix=self.postfix or None, initial=self.initial,
                                 unit_scale=self.unit_scale)

    def _write(self) -> None:
        print(self.line(), file=self.file if self.file is not None else sys.stderr, flush=True)
        self.last = time.monotonic()
        self.lines += 1

    def update(self, n: int = 1) -> None:
        """``n`` more units done; write a line if another :data:`LOG_FRACTION` is done and
        ``interval_s`` has passed since the last one."""
        self.n += int(n)
        if self.n >= self.next and time.monotonic() - self.last >= self.interval_s:
            self._write()
            self.next = self.n + self.step

    def set_postfix(self, **kwargs: Any) -> None:
        """Figures shown after the counts, e.g. ``loss=0.0321`` (as tqdm's ``set_postfix``)."""
        self.postfix = ", ".join(f"{k}={v}" for k, v in kwargs.items())

    def close(self) -> None:
        """Write the last line if the bar ran at least ``interval_s`` (idempotent)."""
        if not self.closed and time.monotonic() - self.start >= self.interval_s and self.n > self.initial:
            self._write()
        self.closed = True

    def __enter__(self) -> LogLines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_bar(total: int, desc: str = "", unit: str = "it", initial: int = 0,
                 unit_scale: bool = False) -> tqdm | LogLines:
    """A progress display for ``total`` units: a tqdm bar redrawn at most every
    :data:`TERMINAL_INTERVAL_S` s on a terminal, else :class:`LogLines` (see the module docstring).
    ``unit_scale``: counts with SI prefixes (bytes as ``1.23GB``)."""
    if os.environ.get("TQDM_DISABLE", "").strip().lower() in ("1", "true", "yes"):  # tqdm's own switch (the benchmarks set it)
        return LogLines(total, desc, unit, initial, interval_s=math.inf, unit_scale=unit_scale)
    if on_terminal():
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, unit_scale=unit_scale,
                    mininterval=TERMINAL_INTERVAL_S)
    return LogLines(total, desc, unit, initial, unit_scale=unit_scale)


def quiet_library_bars() -> None:
    """Turn off the progress bars transformers draws itself when progress is not drawn as a bar
    (:func:`on_terminal`): in a log file each would be a line per redraw."""
    if on_terminal():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # for a transformers not imported yet
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
