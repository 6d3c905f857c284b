"""The report's utilisation table: per compute phase of an experiment (cache build, each block,
healing, scoring) its seconds, FLOPs (counted by :mod:`zgcore.evaluation.flops`), achieved FLOP/s
and MFU against the matmul peak measured in the process that ran it
(:func:`zgcore.training.mfu.probe`), or, where that process recorded none, in the report's own."""
from __future__ import annotations

from typing import Any
from collections.abc import Callable, Mapping, Sequence

from zgcore.markdown import num, table


def phase(name: str, seconds: float, flops: int, peak: Mapping[str, Any], probed: str = "task") -> dict[str, Any]:
    """One row: ``{"phase", "seconds", "flops", "gflops_per_second", "mfu", "peak_gflops_per_second",
    "peak_dtype", "probed"}`` (``probed``: ``"task"`` when the peak is the phase's own process's,
    ``"report"`` when the report's process measured it). Rates are None when ``seconds`` is not positive."""
    rate = flops / seconds if seconds and seconds > 0 else None
    p = float(peak["peak_flops_per_second"])
    return {"phase": name, "seconds": float(seconds), "flops": int(flops),
            "gflops_per_second": rate / 1e9 if rate is not None else None, "mfu": rate / p if rate is not None else None,
            "peak_gflops_per_second": p / 1e9, "peak_dtype": peak["dtype"], "probed": probed}


def from_metrics(name: str, m: Mapping[str, Any], fallback: Callable[[], Mapping[str, Any]],
                 flops: int | None = None) -> dict[str, Any]:
    """A row from a task's ``metrics.json`` ``m``: its own ``flops`` and ``peak`` where it recorded
    them (:func:`zgcore.training.mfu.utilisation`), else ``flops`` and the peak ``fallback()`` measures
    (an output written before tasks recorded their own)."""
    own = m.get("peak")
    if own and "flops" in m:
        return phase(name, float(m["seconds"]), int(m["flops"]), own)
    return phase(name, float(m["seconds"]), int(flops or 0), fallback(), "report")


def markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The table (phase, seconds, achieved GFLOP/s, MFU, peak) with one sentence on how it is measured."""
    if not rows:
        return ""
    body = [[r["phase"], num(r["seconds"], ".2f"), num(r["gflops_per_second"], ".2f"), num(r["mfu"], ".1%"),
             f"{num(r['peak_gflops_per_second'], '.1f')} ({r['peak_dtype']}, {r['probed']})"] for r in rows]
    return "\n".join(["## Compute utilisation", "",
                      "Achieved FLOP/s of each phase (FLOPs counted per Kaplan et al. 2020: 2 per parameter and token "
                      "forward, 3 forwards per training step) over the peak of a matmul probe in the process that ran it "
                      "(`task`) or, where that process recorded none, in the report's (`report`).", "",
                      table(["phase", "seconds", "achieved GFLOP/s", "MFU", "peak GFLOP/s (dtype, probed in)"], body), ""])
