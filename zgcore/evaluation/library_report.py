"""The library's report: the candidate table, the student chosen for each budget, the uniform
students (one variant at every partition), each budget's comparison with the best uniform student
that fits it, and the quality-size plot (held-out CE against non-embedding parameters).

Comparisons are :func:`zgcore.evaluation.compare.compare` (paired bootstrap over the test rows; one
training seed, so a verdict describes this run and does not conclude a method comparison).
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zgcore.evaluation.compare import compare, sentence
from zgcore.evaluation.compare import markdown as comparisons_md
from zgcore.evaluation.plots import _pyplot, _save
from zgcore.markdown import num, table


def best_uniform(uniform: Sequence[Mapping[str, Any]], unit: str, budget: float) -> Mapping[str, Any] | None:
    """The uniform student of lowest held-out CE whose cost in ``unit`` fits ``budget`` (None if none fits)."""
    fits = [u for u in uniform if u["cost"][unit] <= budget]
    return min(fits, key=lambda u: u["ce"]) if fits else None


def comparisons(selections: Sequence[Mapping[str, Any]], uniform: Sequence[Mapping[str, Any]], unit: str,
                scores: Mapping[str, Mapping[str, Any]], seed: int) -> list[dict[str, Any]]:
    """Each budget's selected student against the best uniform student within the same budget, on
    the test rows and every ``eval.extra`` corpus.

    Args:
        selections: ``{"budget", "model", ...}`` per budget. uniform: ``{"name", "model", "ce", "cost"}``.
        scores: model folder -> :func:`zgcore.evaluation.compare.load_scores` of its evaluation.
        seed: the training seed (one).

    Returns:
        :func:`compare` results with ``"budget"`` and ``"held_out"`` (None in-domain); a budget
        whose best uniform student is the selected student itself, or that no uniform student
        fits, gets ``{"budget", "note"}`` instead.
    """
    out = []
    for s in selections:
        u = best_uniform(uniform, unit, s["budget"])
        if u is None:
            out.append({"budget": s["budget"], "note": "no uniform student fits this budget"})
            continue
        if u["model"] == s["model"]:
            out.append({"budget": s["budget"], "note": f"the selected student is the uniform student {u['name']}"})
            continue
        a, b = scores[s["model"]], scores[u["model"]]
        for held_out, pa, pb in [(None, a["val"], b["val"])] + [(k, a["extra"][k], b["extra"][k]) for k in a.get("extra", {})]:
            c = compare(f"selected@{s['budget']:.4g}", f"uniform {u['name']}", [np.asarray(pa["ce"]["student"])],
                        [np.asarray(pb["ce"]["student"])], [seed])
            out.append({**c, "budget": s["budget"], "held_out": held_out})
    return out


def plot(selections: Sequence[Mapping[str, Any]], uniform: Sequence[Mapping[str, Any]], path: str | os.PathLike,
         teacher_params: float | None = None) -> None:
    """PNG: held-out CE (nats/token) against non-embedding parameters, selected students (one per
    budget, joined) beside the uniform students (each labelled with its variant)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    sel = sorted(selections, key=lambda s: s["params"])
    ax.plot([s["params"] for s in sel], [s["ce"] for s in sel], marker="o", color="tab:red", label="selected (per budget)")
    ax.scatter([u["params"] for u in uniform], [u["ce"] for u in uniform], marker="s", color="tab:blue", label="uniform")
    for u in uniform:
        ax.annotate(u["name"], (u["params"], u["ce"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if teacher_params:
        ax.axvline(teacher_params, color="k", linestyle=":", label="teacher's size")
    ax.set_xlabel("non-embedding parameters")
    ax.set_ylabel("held-out CE (nats/token)")
    ax.set_title("Quality against size")
    ax.legend(fontsize=8)
    _save(fig, path)


def markdown(report: Mapping[str, Any]) -> str:
    """The report as Markdown: candidates, selections, uniform students, comparisons."""
    unit = report["budget_unit"]
    lines = [f"# Library: {report['name']}", "",
             f"Teacher `{report['teacher']}`: {report['teacher_cost']['params']:,} non-embedding parameters, "
             f"{report['teacher_cost']['flops']:,.0f} FLOPs/token at T={report['seq_len']}, "
             f"{report['teacher_cost']['kv_bytes']:,} KV bytes/token. Budgets in `{unit}`.", "",
             "## Candidates", "",
             "CE increase: held-out CE (nats/token) of the teacher with this partition replaced by the candidate, "
             "minus the teacher's, on the tuning rows (validation sequences outside the test subset).", ""]
    rows = [[c["partition"], c["name"], f"{c['params']:,}", f"{c['flops']:,.0f}", f"{c['kv_bytes']:,}",
             num(c["ce_increase"], "+.4f"), num(c["block_loss"], ".4f")] for c in report["candidates"]]
    lines += [table(["partition", "variant", "params", "FLOPs/token", "KV bytes/token", "CE increase", "block loss"], rows), ""]
    lines += ["## Selected students", ""]
    rows = [[f"{s['budget']:,.0f}" + (f" ({s['budget_raw']:g})" if s["budget_raw"] <= 1 else ""),
             " / ".join(s["chosen"]), f"{s['params']:,}", num(s["predicted_increase"], "+.4f"), num(s["ce"], ".4f"),
             ", ".join(f"{k} {num(v, '.4f')}" for k, v in s["extra"].items()) or "—", f"`{s['model']}`"]
            for s in report["selections"]]
    lines += [table(["budget", "chosen (per partition)", "params", "summed CE increase", "held-out CE", "out-of-domain CE", "model"],
                    rows), ""]
    lines += ["## Uniform students (one variant at every partition)", ""]
    rows = [[u["name"], f"{u['params']:,}", num(u["ce"], ".4f"),
             ", ".join(f"{k} {num(v, '.4f')}" for k, v in u["extra"].items()) or "—"] for u in report["uniform"]]
    lines += [table(["variant", "params", "held-out CE", "out-of-domain CE"], rows), ""]
    lines += ["## Selected against the best uniform student within the same budget", ""]
    notes = [c for c in report["comparisons"] if "note" in c]
    full = [c for c in report["comparisons"] if "note" not in c]
    lines += [f"- budget {c['budget']:,.0f}: {c['note']}" for c in notes]
    if full:
        lines += [""] + [f"- budget {c['budget']:,.0f} ({c['held_out'] or 'in-domain'}): {sentence(c)}" for c in full]
        lines += ["", comparisons_md(full), "", "One training seed: these verdicts describe this run; a method "
                  "comparison needs at least 3 seeds."]
    lines += ["", "![quality against size](quality_size.png)", ""]
    return "\n".join(lines)
