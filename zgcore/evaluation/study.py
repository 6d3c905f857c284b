"""Aggregating reports: several seeds of one experiment, and the six-arm objective study.

Each Evaluate report already carries its gap recovered (or why it is undefined) and its gates
(:mod:`zgcore.evaluation.report`); aggregates never average an undefined gap, and every table is built with
:func:`zgcore.markdown.table` and :func:`zgcore.markdown.num`."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

import numpy as np

from zgcore.evaluation.compare import DESCRIPTIVE, compare_arms, descriptive, markdown as compare_md, sentence
from zgcore.markdown import num, table
from zgcore.evaluation.report import gap_text, gate_text


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0.0 for a single value)."""
    xs = list(xs)
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def seed_summary(reports: Sequence[dict[str, Any]], seeds: Sequence[int],
                 scores: Sequence[Mapping[str, np.ndarray]] | None = None) -> dict[str, Any]:
    """Per-seed and mean ± std of held-out CE, gap recovered and context use; gates per seed; and
    ``comparisons`` (:mod:`zgcore.evaluation.compare`, pooled over seeds): the assembled student against the
    untrained student and against the teacher.

    Args:
        reports: Evaluate ``report.json`` dicts, one per seed, in ``seeds`` order.
        scores: per seed, model key (``teacher``, ``untrained``, ``student``) -> per-sequence CE
            ``[n]`` (the ``val`` part of each Evaluate's ``per_sequence_ce.json``); None: no comparisons.
    """
    rows = []
    for s, r in zip(seeds, reports):
        cu = r.get("context_use") or {}
        rows.append({"seed": s, "ce_teacher": r["cross_entropy"]["teacher"], "ce_untrained": r["cross_entropy"]["untrained"],
                     "ce_student": r["cross_entropy"]["student"], "gap_recovered": r["gap_recovered"],
                     "gap_reason": r.get("gap_reason"), "context_use_student": cu.get("student", {}).get("context_use"),
                     "gates": {k: v["passed"] for k, v in r.get("gates", {}).items()},
                     "extra": {e["name"]: {"ce_student": e["cross_entropy"]["student"], "gap_recovered": e.get("gap_recovered")}
                               for e in r.get("extra") or []}})
    agg, undefined = {}, {}
    for k in ("ce_student", "gap_recovered", "context_use_student"):
        vals = [r[k] for r in rows]
        if any(v is None for v in vals):  # a missing, non-finite or undefined figure: no mean of the rest
            undefined[k] = f"undefined for seed(s) {[r['seed'] for r in rows if r[k] is None]}"
        else:
            agg[k] = dict(zip(("mean", "std"), mean_std(vals)))
    comparisons = []
    if scores is not None:
        arms = {k: {s: sc[k] for s, sc in zip(seeds, scores)} for k in ("student", "untrained", "teacher")}
        comparisons = compare_arms([("student", "untrained"), ("student", "teacher")], arms,
                                   groups=scores[0].get("documents") if scores else None)
        if reports and reports[0].get("teacher_note"):  # a random teacher: a plumbing check, no verdict
            descriptive(comparisons)
    return {"seeds": list(seeds), "rows": rows, "aggregate": agg, "undefined": undefined, "comparisons": comparisons,
            "teacher_note": reports[0].get("teacher_note") if reports else None,
            "all_gates_passed": _all_passed([v for r in rows for v in (r["gates"] or {None: None}).values()])}


def _all_passed(results: Sequence[bool | None]) -> bool | None:
    """False if any gate failed, else None (undefined) if any could not be judged, else True."""
    return False if any(v is False for v in results) else None if any(v is None for v in results) else True


def seed_markdown(summary: dict[str, Any], name: str) -> str:
    """Render :func:`seed_summary` as Markdown."""
    lines = [f"# ZeroGraph seeds — {name}", ""]
    if summary.get("teacher_note"):
        lines += [f"**{DESCRIPTIVE}.** **{summary['teacher_note']}**", ""]
    rows = [[r["seed"], num(r["ce_teacher"]), num(r["ce_untrained"]), num(r["ce_student"]),
             gap_text(r["gap_recovered"], r.get("gap_reason")), num(r["context_use_student"], "+.4f"),
             gate_text({k: {"passed": v} for k, v in r["gates"].items()})] for r in summary["rows"]]
    lines += [table(["seed", "teacher CE", "untrained CE", "student CE", "gap recovered", "context use", "gates"], rows), ""]
    lines += [f"- {k}: {num(v['mean'])} ± {num(v['std'])} (mean ± std over {len(summary['rows'])} seeds)"
              for k, v in summary["aggregate"].items()]
    lines += [f"- {k}: {why}" for k, why in summary.get("undefined", {}).items()] + [""]
    for name in summary["rows"][0].get("extra", {}) if summary["rows"] else []:
        per = [r["extra"].get(name, {}) for r in summary["rows"]]
        lines += [f"- out of domain, {name}: student CE " + ", ".join(num(p.get("ce_student")) for p in per)
                  + "; gap recovered " + ", ".join(gap_text(p.get("gap_recovered")) for p in per) + " (per seed)"]
    return "\n".join(lines + [""] + comparisons_lines(summary.get("comparisons")))


def comparisons_lines(comparisons: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """Markdown lines of a report's comparisons: the table, then one sentence per comparison
    (:func:`zgcore.evaluation.compare.sentence`, so a finding is stated only as its verdict allows)."""
    if not comparisons:
        return []
    return (["## Comparisons", "", compare_md(comparisons), ""] + [f"- {sentence(c)}" for c in comparisons] + [""])


def files_identical(a: Sequence[Path], b: Sequence[Path]) -> bool:
    """True when the two lists of files have the same bytes pairwise (and the same length)."""
    return len(a) == len(b) and all(Path(x).read_bytes() == Path(y).read_bytes() for x, y in zip(a, b))


def _reduction(first: float | None, final: float | None) -> float | None:
    """``1 - final / first`` (the share of a loss removed), or ``None`` when either is missing or first is 0."""
    return None if first is None or final is None or first == 0 else 1 - final / first


def blockwise_flops(report: Mapping[str, Any], batch_sizes: Sequence[int], cache_sequences: int | None) -> dict[str, Any] | None:
    """Training FLOPs of one blockwise arm (:func:`zgcore.evaluation.flops.arm_flops`, the one
    counting every study uses) from its Evaluate report (``parameters``, ``blocks``, ``seq_len``);
    ``batch_sizes``: each block's; ``cache_sequences``: the teacher cache's train + val sequences
    (None: online targets). None for a report without ``parameters``."""
    from zgcore.evaluation.flops import arm_flops

    par = report.get("parameters")
    if not par:
        return None
    return arm_flops("blockwise", int(report["seq_len"]), par["teacher"], par["student"], report["blocks"], batch_sizes,
                     cache_sequences=cache_sequences)


def objective_study(arms: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Compare study arms.

    Args:
        arms: dicts with ``objective``, ``targets``, ``seed``, ``report`` (Evaluate report.json),
            ``block_files`` (paths of the arm's ``block.safetensors`` in block order).

    Returns:
        ``rows`` (one per arm: local objective's final value per block, its reduction from the first
        step (``None`` for an ``attention_transfer`` block, whose loss changes quantity), held-out CE,
        gap recovered, context use, gates), ``identical`` (per objective and
        seed: whether the cached and online arms' block weights are byte-identical) and
        ``comparisons`` (:mod:`zgcore.evaluation.compare`, pooled over seeds; needs each arm's ``scores``, the
        student's per-sequence CE ``[n]``): per target source noisy vs clean, denoise vs clean,
        denoise vs noisy; per objective online vs cached.
    """
    rows, identical = [], {}
    for a in arms:
        r = a["report"]
        blocks = r["blocks"]
        cu = (r.get("context_use") or {}).get("student", {}).get("context_use")
        rows.append({"arm": f"{a['objective']}/{a['targets']}" + (f"/s{a['seed']}" if a.get("multi_seed") else ""),
                     "objective": a["objective"], "targets": a["targets"], "seed": a["seed"],
                     "local_final": [b["final_loss"] for b in blocks],
                     # an attention-transfer block's first loss is an attention-output error and its last a
                     # boundary error once train.transfer_steps end: two quantities, no reduction between them
                     "local_reduction": [None if b.get("objective") == "attention_transfer"
                                         else _reduction(b["first_loss"], b["final_loss"]) for b in blocks],
                     "ce_student": r["cross_entropy"]["student"], "ce_teacher": r["cross_entropy"]["teacher"],
                     "ce_untrained": r["cross_entropy"]["untrained"], "gap_recovered": r["gap_recovered"],
                     "gap_reason": r.get("gap_reason"), "teacher_note": r.get("teacher_note"),
                     "context_use": cu, "gates": {k: v["passed"] for k, v in r.get("gates", {}).items()},
                     "seconds": sum(b["seconds"] for b in blocks), "flops": a.get("flops")})
    by_key: dict[tuple, dict[str, list]] = {}
    for a in arms:
        by_key.setdefault((a["objective"], a["seed"]), {})[a["targets"]] = a["block_files"]
    for (obj, seed), d in by_key.items():
        if "cached" in d and "online" in d:
            identical[f"{obj}/s{seed}"] = files_identical(d["cached"], d["online"])
    groups: dict[str, dict[int, np.ndarray]] = {}
    for a in arms:
        if a.get("scores") is not None:
            groups.setdefault(f"{a['objective']}/{a['targets']}", {})[a["seed"]] = a["scores"]
    objs = list(dict.fromkeys(a["objective"] for a in arms))
    tgs = list(dict.fromkeys(a["targets"] for a in arms))
    pairs = [(f"{x}/{tg}", f"{y}/{tg}") for tg in tgs for x, y in (("noisy", "clean"), ("denoise", "clean"), ("denoise", "noisy"))]
    pairs += [(f"{o}/online", f"{o}/cached") for o in objs] + [(f"attention_transfer/{tg}", f"clean/{tg}") for tg in tgs]
    comps = compare_arms(pairs, groups, groups=next((a.get("documents") for a in arms if a.get("scores") is not None), None))
    if any(r.get("teacher_note") for r in rows):  # a random teacher: a plumbing check, no verdict
        descriptive(comps)
    out = {"rows": rows, "identical": identical, "comparisons": comps}
    mixers = dict.fromkeys((b["mixer"], b.get("window")) for a in arms for b in a["report"]["blocks"]
                           if b.get("mixer", "softmax") != "softmax")
    if mixers:  # a conversion study: which mixer replaced the teacher's attention, over which window
        out["conversion"] = "; ".join(f"mixer {m}" + (f", window {w} tokens" if w is not None else "")
                                      for m, w in mixers)
    return out


def study_markdown(study: dict[str, Any]) -> str:
    """Render :func:`objective_study` as Markdown (the arms plot is linked as ``arms.png``): the
    objective study, or the conversion study when its students' blocks replace the teacher's
    attention (``"conversion"``: the mixer and its window) or an arm transfers attention."""
    conv = study.get("conversion") or (
        "teacher attention" if any(r["objective"] == "attention_transfer" for r in study["rows"]) else None)
    if conv:
        lines = [f"# ZeroGraph conversion study: {conv}", "",
                 f"Student blocks: {conv} in place of the teacher's attention (train.mixer, train.window), each "
                 "arm starting from the teacher's projections.", ""]
    else:
        lines = ["# ZeroGraph objective study", ""]
    note = next((r["teacher_note"] for r in study["rows"] if r.get("teacher_note")), None)
    if note:
        lines += [f"**{DESCRIPTIVE}.** **{note}**", ""]
    rows = [[r["arm"], ", ".join(num(x) for x in r["local_final"]), ", ".join(num(x, ".2%") for x in r["local_reduction"]),
             num(r["ce_student"]), gap_text(r["gap_recovered"]), num(r["context_use"], "+.4f"),
             gate_text({k: {"passed": v} for k, v in r["gates"].items()}), num(r["seconds"], ".0f"),
             num((r.get("flops") or {}).get("total"), ".3e")] for r in study["rows"]]
    lines += ["Arms: block objective x target source, same teacher, corpus, seeds and teacher cache. "
              "Local objective = each block's own training loss (final value, and its reduction from step 1).", "",
              table(["arm", "local loss per block (final)", "local reduction", "held-out CE", "gap recovered", "context use",
                     "gates", "train s", "training FLOPs"], rows), "",
              "Training FLOPs: student forward and backward of every block, plus the teacher's forwards (the whole "
              "cache build for cached arms, each step's forward for online ones); zgcore.evaluation.flops."]
    if any(r["objective"] == "attention_transfer" for r in study["rows"]):
        lines += ["", "Attention-transfer arms show no local reduction: a block's first loss is the error of its mixers' "
                  "outputs against the teacher attention's, its final loss (after train.transfer_steps) a boundary "
                  "error, so the two do not measure one thing."]
    if study["rows"]:
        r0 = study["rows"][0]
        lines += ["", f"Teacher held-out CE {num(r0['ce_teacher'])}; untrained student {num(r0['ce_untrained'])} nats/token."]
        if r0["gap_recovered"] is None and r0.get("gap_reason"):
            lines += ["", f"Gap recovered is undefined: {r0['gap_reason']}."]
    if study["identical"]:
        lines += ["", "Cached vs online block weights, byte for byte:", ""]
        lines += [f"- {k}: {'identical' if v else 'DIFFERENT'}" for k, v in study["identical"].items()]
    else:
        lines += ["", "Cached vs online block weights: not compared (no objective and seed was trained from both "
                  "target sources; an arm with online targets adds the byte-for-byte check)."]
    lines += ["", "![arms](arms.png)", ""]
    return "\n".join(lines + comparisons_lines(study.get("comparisons")))
