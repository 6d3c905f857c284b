"""The library's report: the candidate table, the student chosen for each budget, the uniform
students (one variant at every partition), each budget's comparison with the best uniform student
that fits it, and the quality-size plot (held-out CE against non-embedding parameters).

Comparisons go through :func:`zgcore.evaluation.compare.compare_arms` as trained configurations
(two student shapes, each trained once per seed): with one training seed they are "not resolved
(fewer than 3 runs)", their intervals describing these two models only; documents are resampled
where the corpus records them; Holm runs over the report's comparisons. A random (``tiny-*``)
teacher's report carries the plumbing-check banner and no verdict.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zgcore.evaluation.compare import DESCRIPTIVE, compare_arms, descriptive, holm, sentence
from zgcore.evaluation.compare import markdown as comparisons_md
from zgcore.evaluation.plots import _pyplot, _save
from zgcore.markdown import num, table


def best_uniform(uniform: Sequence[Mapping[str, Any]], unit: str, budget: float) -> Mapping[str, Any] | None:
    """The uniform student of lowest held-out CE whose cost in ``unit`` fits ``budget`` (None if none fits)."""
    fits = [u for u in uniform if u["cost"][unit] <= budget]
    return min(fits, key=lambda u: u["ce"]) if fits else None


def budget_label(budget: float) -> str:
    """A budget as a report writes it: ``"84,960,000"`` (never scientific notation); a fraction below 1 as ``"0.7"``."""
    return f"{budget:,.0f}" if budget >= 1 else f"{budget:g}"


def comparisons(selections: Sequence[Mapping[str, Any]], uniform: Sequence[Mapping[str, Any]], unit: str,
                scores: Mapping[str, Mapping[str, Any]], seed: int, plumbing: bool = False) -> list[dict[str, Any]]:
    """Each budget's selected student against the best uniform student within the same budget, on
    the test rows and every ``eval.extra`` corpus: trained configurations
    (:func:`zgcore.evaluation.compare.compare_arms`, Holm over all of them), documents resampled
    where the scores record them.

    Args:
        selections: ``{"budget", "model", ...}`` per budget (``"flops"``: FLOPs/token, and
            ``"train_flops"``, carried into the comparison). uniform: ``{"name", "model", "ce", "cost"}``.
        scores: model folder -> :func:`zgcore.evaluation.compare.load_scores` of its evaluation.
        seed: the training seed (one). plumbing: a random teacher's library (no verdict, ever).

    Returns:
        Comparison dicts with ``"budget"``, ``"held_out"`` (None in-domain) and ``"flops"``
        (``{arm: FLOPs/token}``); a budget whose best uniform student is the selected student itself,
        or that no uniform student fits, gets ``{"budget", "note"}`` instead.
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
        na, nb = f"selected@{budget_label(s['budget'])}", f"uniform {u['name']}"
        for held_out, pa, pb in [(None, a["val"], b["val"])] + [(k, a["extra"][k], b["extra"][k]) for k in a.get("extra", {})]:
            arms = {na: {seed: np.asarray(pa["ce"]["student"])}, nb: {seed: np.asarray(pb["ce"]["student"])}}
            (c,) = compare_arms([(na, nb)], arms, groups=pa.get("documents"))
            out.append({**c, "budget": s["budget"], "held_out": held_out,
                        "flops": {na: s.get("flops"), nb: (u.get("cost") or {}).get("flops")},
                        "train_flops": {na: s.get("train_flops"), nb: u.get("train_flops")}})
    full = holm([c for c in out if "note" not in c])
    if plumbing:
        descriptive(full)
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
    lines = [f"# Library: {report['name']}", ""]
    if report.get("teacher_note"):
        lines += [f"**{DESCRIPTIVE}.** **{report['teacher_note']}**", ""]
    lines += [f"Teacher `{report['teacher']}`: {report['teacher_cost']['params']:,} non-embedding parameters, "
             f"{report['teacher_cost']['flops']:,.0f} FLOPs/token at T={report['seq_len']}, "
             f"{report['teacher_cost']['kv_bytes']:,} KV bytes/token. Budgets in `{unit}`.", "",
             "## Candidates", "",
             "CE increase: held-out CE (nats/token) of the teacher with this partition replaced by the candidate, "
             "minus the teacher's, on the tuning rows (validation sequences outside the test subset).", ""]
    rows = [[c["partition"], c["name"], f"{c['params']:,}", f"{c['flops']:,.0f}", f"{c['kv_bytes']:,}",
             num(c["ce_increase"], "+.4f"), num(c["block_loss"], ".4f")] for c in report["candidates"]]
    lines += [table(["partition", "variant", "params", "FLOPs/token", "KV bytes/token", "CE increase", "block loss"], rows), ""]
    lines += ["## Selected students", ""]
    rows = [[budget_label(s["budget"]) + (f" ({s['budget_raw']:g})" if s["budget_raw"] <= 1 else ""),
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
    lines += [f"- budget {budget_label(c['budget'])}: {c['note']}" for c in notes]
    if full:
        lines += [""] + [f"- budget {budget_label(c['budget'])} ({c['held_out'] or 'in-domain'}): {sentence(c)}" for c in full]
        lines += ["", comparisons_md(full), "",
                  table(["budget", "arm", "FLOPs/token (inference)", "training FLOPs (its blocks, student side)"],
                        [[budget_label(c["budget"]), k, num(v, ",.0f"), num((c.get("train_flops") or {}).get(k), ".3e")]
                         for c in full if c.get("held_out") is None for k, v in (c.get("flops") or {}).items()]), "",
                  "Two student shapes are trained configurations: from one training seed a comparison describes "
                  "these two models and has no verdict; a method comparison needs at least 3 seeds."]
    lines += ["", "![quality against size](quality_size.png)", ""]
    return "\n".join(lines)
