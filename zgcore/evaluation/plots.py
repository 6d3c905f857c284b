"""Report figures (PNG, matplotlib's Agg backend): loss curves, boundary drift, study arms."""
from __future__ import annotations

import csv
import math
import os
from typing import Any
from collections.abc import Sequence

from zgcore.atomic import atomic_path


def _pyplot():
    """matplotlib's pyplot on the Agg backend, imported when a figure is drawn, not when the task
    graph is built, so that a command that draws nothing does not pay for the import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | os.PathLike) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)


def loss_curves(logs: Sequence[tuple[str, str | os.PathLike]], path: str | os.PathLike) -> None:
    """Plot each block's per-step training loss from its ``loss_log.csv`` (``[(label, csv_path)]``)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, f in logs:
        with open(f) as fh:
            rows = list(csv.DictReader(fh))
        ax.plot([int(r["step"]) for r in rows], [float(r["loss"]) for r in rows], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("block loss (normalised MSE)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("Per-block training loss")
    _save(fig, path)


def drift(shift: dict[str, Any], path: str | os.PathLike) -> None:
    """Plot the assembled student's residual-stream drift from the teacher at each boundary."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    d = shift["drift"]
    ax.plot([r["boundary"] for r in d], [r["relative_error"] for r in d], marker="o")
    ax.set_xlabel("boundary (teacher layer index)")
    ax.set_ylabel("relative error vs teacher")
    ax.set_title("Boundary drift of the assembled student")
    _save(fig, path)


def arms(rows: Sequence[dict[str, Any]], path: str | os.PathLike, metric: str = "ce_student",
         label: str = "held-out CE (nats/token)", teacher: float | None = None) -> None:
    """Bar chart of one metric per study arm (``rows`` with ``arm`` and ``metric`` keys)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([r["arm"] for r in rows], [math.nan if r[metric] is None else r[metric] for r in rows], color="tab:blue")  # None: not finite
    if teacher is not None:
        ax.axhline(teacher, color="k", linestyle="--", label="teacher")
        ax.legend()
    ax.set_ylabel(label)
    ax.tick_params(axis="x", rotation=30)
    _save(fig, path)
