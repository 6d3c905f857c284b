"""Markdown for reports: one table builder and one number formatter that never crashes.

Every report (experiment, seeds, objective study, local-learning study, benchmarks) builds its
tables here, so a figure that is missing or not finite is shown as such instead of raising while
formatting (``format(None, ".4f")`` is a ``TypeError``; ``format(nan, ".4f")`` prints ``nan``
silently).
"""
from __future__ import annotations

import math
from typing import Any
from collections.abc import Iterable, Sequence

MISSING = "—"


def num(value: Any, spec: str = ".4f", missing: str = MISSING) -> str:
    """Format a number for a report.

    Args:
        value: an ``int``/``float`` (or numpy/torch scalar), or ``None``.
        spec: a ``format`` spec such as ``".4f"``, ``"+.3f"``, ``".1%"``.
        missing: what ``None`` becomes.

    Returns:
        The formatted number; ``missing`` for ``None``; ``"NaN (not finite)"``, ``"inf (not finite)"``
        or ``"-inf (not finite)"`` for non-finite values, so a reader sees which figure is broken.
        Non-numeric values are returned as ``str(value)``.
    """
    if value is None:
        return missing
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return f"{'NaN' if math.isnan(value) else ('inf' if value > 0 else '-inf')} (not finite)"
    return format(value, spec)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table.

    Args:
        header: column titles.
        rows: one sequence of cells per row, as long as ``header``; cells are used as ``str(cell)``
            (format numbers with :func:`num` first). A ``|`` inside a cell is escaped.

    Returns:
        The table as lines joined by newlines, without a trailing newline.

    Raises:
        ValueError: a row whose length differs from the header's.
    """
    def cell(c: Any) -> str:
        return str(c).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    for i, r in enumerate(rows):
        r = list(r)
        if len(r) != len(header):
            raise ValueError(f"table row {i} has {len(r)} cells, the header {len(header)}")
        lines.append("| " + " | ".join(cell(c) for c in r) + " |")
    return "\n".join(lines)
