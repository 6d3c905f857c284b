"""Aggregating reports: several seeds of one experiment, and the six-arm objective study."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Sequence


def _num(x) -> float:
    """A report number read back from JSON: ``None`` (a NaN when written) becomes NaN."""
    return float("nan") if x is None else float(x)


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0.0 for a single value)."""
    xs = list(xs)
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def seed_summary(reports: Sequence[dict[str, Any]], seeds: Sequence[int]) -> dict[str, Any]:
    """Per-seed and mean ± std of held-out CE, gap recovered and context use; gates per seed.

    Args:
        reports: Evaluate ``report.json`` dicts, one per seed, in ``seeds`` order.
    """
    rows = []
    for s, r in zip(seeds, reports):
        cu = r.get("context_use") or {}
        rows.append({"seed": s, "ce_teacher": r["cross_entropy"]["teacher"], "ce_untrained": r["cross_entropy"]["untrained"],
                     "ce_student": r["cross_entropy"]["student"], "gap_recovered": _num(r["gap_recovered"]),
                     "context_use_student": cu.get("student", {}).get("context_use"),
                     "gates": {k: v["passed"] for k, v in r.get("gates", {}).items()}})
    agg = {}
    for k in ("ce_student", "gap_recovered", "context_use_student"):
        vals = [r[k] for r in rows if r[k] is not None]
        if vals:
            agg[k] = dict(zip(("mean", "std"), mean_std(vals)))
    return {"seeds": list(seeds), "rows": rows, "aggregate": agg,
            "all_gates_passed": all(all(r["gates"].values()) for r in rows)}


def seed_markdown(summary: dict[str, Any], name: str) -> str:
    """Render :func:`seed_summary` as Markdown."""
    lines = [f"# ZeroGraph seeds — {name}", "", "| seed | teacher CE | untrained CE | student CE | gap recovered | context use | gates |",
             "|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        cu = "" if r["context_use_student"] is None else f"{r['context_use_student']:+.4f}"
        g = ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in r["gates"].items())
        lines.append(f"| {r['seed']} | {r['ce_teacher']:.4f} | {r['ce_untrained']:.4f} | {r['ce_student']:.4f} | "
                     f"{100 * r['gap_recovered']:.1f}% | {cu} | {g} |")
    lines += [""] + [f"- {k}: {v['mean']:.4f} ± {v['std']:.4f} (mean ± std over {len(summary['rows'])} seeds)"
                     for k, v in summary["aggregate"].items()] + [""]
    return "\n".join(lines)


def files_identical(a: Sequence[Path], b: Sequence[Path]) -> bool:
    """True when the two lists of files have the same bytes pairwise (and the same length)."""
    return len(a) == len(b) and all(Path(x).read_bytes() == Path(y).read_bytes() for x, y in zip(a, b))


def objective_study(arms: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Compare study arms.

    Args:
        arms: dicts with ``objective``, ``targets``, ``seed``, ``report`` (Evaluate report.json),
            ``block_files`` (paths of the arm's ``block.safetensors`` in block order).

    Returns:
        ``rows`` (one per arm: local objective's final value per block, its reduction from the first
        step, held-out CE, gap recovered, context use, gates) and ``identical`` (per objective and
        seed: whether the cached and online arms' block weights are byte-identical).
    """
    rows, identical = [], {}
    for a in arms:
        r = a["report"]
        blocks = r["blocks"]
        cu = (r.get("context_use") or {}).get("student", {}).get("context_use")
        rows.append({"arm": f"{a['objective']}/{a['targets']}" + (f"/s{a['seed']}" if a.get("multi_seed") else ""),
                     "objective": a["objective"], "targets": a["targets"], "seed": a["seed"],
                     "local_final": [b["final_loss"] for b in blocks],
                     "local_reduction": [1 - b["final_loss"] / b["first_loss"] for b in blocks],
                     "ce_student": r["cross_entropy"]["student"], "ce_teacher": r["cross_entropy"]["teacher"],
                     "ce_untrained": r["cross_entropy"]["untrained"], "gap_recovered": _num(r["gap_recovered"]),
                     "context_use": cu, "gates": {k: v["passed"] for k, v in r.get("gates", {}).items()},
                     "seconds": sum(b["seconds"] for b in blocks)})
    by_key: dict[tuple, dict[str, list]] = {}
    for a in arms:
        by_key.setdefault((a["objective"], a["seed"]), {})[a["targets"]] = a["block_files"]
    for (obj, seed), d in by_key.items():
        if "cached" in d and "online" in d:
            identical[f"{obj}/s{seed}"] = files_identical(d["cached"], d["online"])
    return {"rows": rows, "identical": identical}


def study_markdown(study: dict[str, Any]) -> str:
    """Render :func:`objective_study` as Markdown (the arms plot is linked as ``arms.png``)."""
    lines = ["# ZeroGraph objective study", "",
             "Arms: block objective x target source, same teacher, corpus, seeds and teacher cache. "
             "Local objective = each block's own training loss (final value, and its reduction from step 1).", "",
             "| arm | local loss per block (final) | local reduction | held-out CE | gap recovered | context use | gates | train s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in study["rows"]:
        g = ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in r["gates"].items())
        cu = "" if r["context_use"] is None else f"{r['context_use']:+.4f}"
        lines.append(f"| {r['arm']} | {', '.join(f'{x:.4f}' for x in r['local_final'])} | "
                     f"{', '.join(f'{100 * x:.2f}%' for x in r['local_reduction'])} | {r['ce_student']:.4f} | "
                     f"{100 * r['gap_recovered']:.1f}% | {cu} | {g} | {r['seconds']:.0f} |")
    if study["rows"]:
        r0 = study["rows"][0]
        lines += ["", f"Teacher held-out CE {r0['ce_teacher']:.4f}; untrained student {r0['ce_untrained']:.4f} nats/token."]
    lines += ["", "Cached vs online block weights, byte for byte:", ""]
    lines += [f"- {k}: {'identical' if v else 'DIFFERENT'}" for k, v in study["identical"].items()]
    lines += ["", "![arms](arms.png)", ""]
    return "\n".join(lines)
