"""The distillation study's report: blockwise (ZeroGraph) vs end-to-end distillation vs
blockwise + healing on the same student and training tokens, side by side — held-out CE, gap
recovered, context use, gates, wall time, peak resident memory of the largest task, how many
tasks could run at once, and the student layer-token passes each arm spent.
"""
from __future__ import annotations

import json
from typing import Any
from collections.abc import Mapping, Sequence

from zgcore.evaluation import report as zreport
from zgcore.evaluation.compare import compare_arms, markdown as compare_md, sentence
from zgcore.markdown import num, table

ARMS = {"blockwise": "(a) ZeroGraph blockwise", "e2e": "(b) end-to-end distillation", "healed": "(c) blockwise + healing",
        "e2e_healed": "(d) end-to-end, (c)'s budget"}
# the pairs every distillation report compares (a, b): CE of a minus CE of b; arms a report lacks are skipped.
# (c) vs (d) asks "does healing beat end to end?" at equal compute.
COMPARED = (("blockwise", "e2e"), ("healed", "e2e_healed"), ("healed", "blockwise"), ("healed", "e2e"),
            ("e2e_healed", "e2e"))
MATCHING = ("Budget matching: a student layer-token pass is one token's forward and backward through one student "
            "layer. Blockwise block i spends steps_i x batch_i x seq_len x layers_i of them; an end-to-end step spends "
            "batch x seq_len x L (L = all student layers). The end-to-end arm gets ceil(sum_i steps_i x batch_i x "
            "layers_i / (batch x L)) steps (unless distill.steps is set), on the same training split. Arm (d) is the same "
            "end-to-end training with the passes of (c): blockwise plus healing (heal.steps x heal.batch x seq_len x L), so "
            "(c) against (d) asks whether healing beats end-to-end distillation at equal compute.")


FLOPS_NOTE = ("FLOPs (zgcore.evaluation.flops): student forward and backward of the layers each arm trains (and of "
              "its LM head where the loss goes through it), teacher forwards (the cache build, whole, for cached "
              "targets; every step's forward for online targets and for logit distillation, LM head included). The "
              "arms are matched in layer-token passes, not in FLOPs: the FLOPs columns say what each spent.")
SEEDS_VARY = ("each seed sets the whole run's randomness: the blocks', the end-to-end student's and the healing stage's "
              "initialisation where random and their data order (train.seed, distill.seed, heal.seed)")


def banner(report: Mapping[str, Any]) -> str:
    """The plumbing-check line a report of a random teacher (smoke preset) opens with, or ""."""
    from zgcore.evaluation.compare import DESCRIPTIVE

    return (f"**{DESCRIPTIVE}**: the teacher is a tiny random model (a smoke preset); the figures check the plumbing "
            "and no comparison has a verdict.\n\n") if report.get("descriptive") else ""


def arm(name: str, ce: float, ce_untrained: float, ce_teacher: float, context_use: Mapping[str, Any] | None,
        gate_gap: float, gate_context: float, stages: Sequence[Sequence[Mapping[str, Any]]], passes: int,
        lrs: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """One arm's row.

    Args:
        name: a key of :data:`ARMS`. ce, ce_untrained, ce_teacher: held-out CE, nats/token.
        context_use: ``{"teacher": {...}, "student": {...}}`` from :func:`zgcore.evaluation.metrics.context_use`, or None.
        gate_gap, gate_context: gate thresholds (``eval.gate_*``).
        stages: the arm's tasks in dependency order, grouped by stage; the tasks of a stage could
            run at the same time. Each task: ``{"task", "seconds", "peak_rss_mib"}``.
        passes: student layer-token forward/backward passes spent.
        lrs: the peak lr of each trained part (``{"block 0": {"lr", "search"?}, "heal": {"lr"}}``;
            ``search``: the record of an lr search, :func:`zgcore.training.lr_search.summary` with ``grid``).

    Returns:
        ``name``, ``label``, ``ce``, ``gap_recovered``, ``context_ratio``, ``gates`` (as
        :func:`zgcore.evaluation.report.gates`), ``serial_seconds`` (one worker), ``critical_seconds`` (each
        stage as long as its longest task: enough workers), ``peak_rss_mib`` and ``peak_task`` (the
        largest single task), ``max_parallel`` (tasks in the widest stage), ``tasks``, ``passes``, ``lrs``.
    """
    gap, reason = zreport.gap_recovered(ce_untrained, ce, ce_teacher)
    g = zreport.gates({"gap_recovered": gap, "gap_reason": reason, "context_use": context_use,
                       "cross_entropy": {"teacher": ce_teacher, "untrained": ce_untrained, "student": ce}},
                      gate_gap, gate_context)
    tasks = [t for s in stages for t in s]
    peak = max(tasks, key=lambda t: t.get("peak_rss_mib") or 0.0)
    return {"name": name, "label": ARMS[name], "ce": ce, "gap_recovered": gap, "gap_reason": reason, "gates": g,
            "context_ratio": g.get("context", {}).get("value"),
            "serial_seconds": sum(t["seconds"] for t in tasks),
            "critical_seconds": sum(max(t["seconds"] for t in s) for s in stages),
            "peak_rss_mib": peak.get("peak_rss_mib"), "peak_task": peak["task"],
            "max_parallel": max(len(s) for s in stages), "tasks": len(tasks), "passes": passes, "lrs": dict(lrs or {})}


def lr_text(lrs: Mapping[str, Mapping[str, Any]]) -> str:
    """``block 0: 2e-3 (searched, interior); heal: 1e-4`` — each part's lr, marked where searched."""
    out = []
    for part, v in lrs.items():
        s = v.get("search")
        where = "" if not s else " (searched, at an edge)" if s["at_edge"] else " (searched, interior)"
        out.append(f"{part}: {v['lr']:g}{where}")
    return "; ".join(out) or "—"


def search_lines(report: Mapping[str, Any]) -> list[str]:
    """One line per searched part: every lr tried with its score, the choice and where it sits."""
    from zgcore.training.lr_search import edge_note

    lines, seen = [], set()
    for a in report["arms"]:
        for part, v in (a.get("lrs") or {}).items():
            s = v.get("search")
            if not s or (part, json_key(s)) in seen:
                continue
            seen.add((part, json_key(s)))
            tried = ", ".join(f"{lr:g}: {'diverged' if sc is None else num(sc)}" for lr, sc in zip(s["lrs"], s["scores"]))
            lines.append(f"- {a['label']}, {part}: chosen **{s['best_lr']:g}** ({edge_note(s)}); searched {tried}"
                         + ("; diverged: " + ", ".join(f"{d['lr']:g}" for d in s["diverged"]) if s["diverged"] else ""))
    return lines


def json_key(obj: Any) -> str:
    """A hashable key of a JSON value."""
    return json.dumps(obj, sort_keys=True)


def verdict_gates(arms: Sequence[dict[str, Any]], scores: Mapping[str, Any], untrained: Any, seed: int,
                  groups: Any = None, descriptive: bool = False) -> None:
    """Make each arm's quality gate need the verdict, as :func:`zgcore.evaluation.report.gates` does for an
    experiment: the arm's student must be shown better than the untrained student by a paired
    comparison of the two fixed models (:func:`zgcore.evaluation.compare.compare_arms`, ``"a better"``;
    documents resampled where ``groups``, each sequence's document id, is given). Adds
    ``vs_untrained`` to each arm of ``scores`` (arm name -> per-sequence CE ``[n]``) and fails a
    passed quality gate without that verdict (in place). ``untrained``: the untrained student's
    per-sequence CE on the same sequences. ``descriptive``: a plumbing check (random teacher), whose
    comparisons never have a verdict."""
    from zgcore.evaluation.compare import A_BETTER, compare_arms, descriptive as describe_only

    for a in arms:
        if a["name"] not in scores:
            continue
        (vs,) = compare_arms([(a["name"], "untrained student")], {a["name"]: {seed: scores[a["name"]]},
                                                                 "untrained student": {seed: untrained}},
                             groups=groups, methods=False)
        if descriptive:
            describe_only([vs])
        a["vs_untrained"] = vs
        q = a["gates"]["quality"]
        if q["passed"] and vs["verdict"] != A_BETTER:
            q["passed"], q["reason"] = False, f"not shown better than the untrained student: {sentence(vs)}"


def extra_rows(arm_extra: Mapping[str, Sequence[Mapping[str, Any]]], reference: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The arms on every out-of-domain ``eval.extra`` corpus.

    Args:
        arm_extra: arm name -> its evaluation's ``extra`` entries (``name``, ``cross_entropy`` with a
            ``student`` key, nats/token).
        reference: an Evaluate report's ``extra`` entries: the teacher's and untrained student's CE per corpus.

    Returns:
        Per corpus ``{"name", "ce_teacher", "ce_untrained", "arms": {arm: {"ce", "gap_recovered", "gap_reason"}}}``.
    """
    out = []
    for ref in reference:
        ce_t, ce_u = ref["cross_entropy"]["teacher"], ref["cross_entropy"]["untrained"]
        arms = {}
        for name, entries in arm_extra.items():
            e = next((x for x in entries if x["name"] == ref["name"]), None)
            if e is not None:
                gap, why = zreport.gap_recovered(ce_u, e["cross_entropy"]["student"], ce_t)
                arms[name] = {"ce": e["cross_entropy"]["student"], "gap_recovered": gap, "gap_reason": why}
        out.append({"name": ref["name"], "ce_teacher": ce_t, "ce_untrained": ce_u, "arms": arms})
    return out


def extra_md(report: Mapping[str, Any]) -> str:
    """The out-of-domain table (one row per corpus and arm), or "" without ``eval.extra``."""
    rows = [[x["name"], ARMS.get(k, k), num(v["ce"]), zreport.gap_text(v["gap_recovered"], v.get("gap_reason")),
             num(x["ce_teacher"]), num(x["ce_untrained"])] for x in report.get("extra") or [] for k, v in x["arms"].items()]
    if not rows:
        return ""
    return ("\n## Out-of-domain held-out text (eval.extra, never trained on)\n\n"
            + table(["held-out text", "arm", "CE", "gap recovered", "teacher CE", "untrained CE"], rows) + "\n")


def comparisons(scores: Mapping[str, Mapping[int, Any]], pairs: Sequence[tuple[str, str]] = COMPARED,
                groups: Any = None) -> list[dict[str, Any]]:
    """The study's paired comparisons (:func:`zgcore.evaluation.compare.compare_arms`, Holm-adjusted
    together): ``scores`` maps arm name -> {seed: per-sequence held-out CE ``[n]``, nats/token}; one
    seed compares the fixed models, several seeds the methods (runs). ``groups``: ``[n]`` document ids."""
    return compare_arms(pairs, scores, groups=groups)


def findings(comps: Sequence[Mapping[str, Any]]) -> list[str]:
    """The study's findings, one sentence per comparison, each as its verdict allows
    (:func:`zgcore.evaluation.compare.sentence`; arms named by their labels in :data:`ARMS`)."""
    out = []
    for c in comps:
        named = {**c, "a": ARMS.get(c["a"], c["a"]), "b": ARMS.get(c["b"], c["b"])}
        out.append(sentence(named))
    return out


def comparisons_md(report: Mapping[str, Any]) -> str:
    """The comparisons table and the finding sentences, or "" when the report has none."""
    comps = report.get("comparisons") or []
    if not comps:
        return ""
    return ("\n## Comparisons\n\n" + compare_md(comps) + "\n\n" + "\n".join(f"- {x}" for x in findings(comps)) + "\n")


def markdown(report: Mapping[str, Any]) -> str:
    """The study report as Markdown (one table: each arm's CE beside its passes and lrs; the budget
    matching, the lr searches, the reference CEs)."""
    rows = []
    for a in report["arms"]:
        fl = a.get("flops") or {}
        rows.append([a["label"], num(a["ce"]), f"{a['passes']:,}", num(fl.get("student"), ".3e"), num(fl.get("teacher"), ".3e"),
                     num(fl.get("total"), ".3e"), lr_text(a.get("lrs") or {}),
                     zreport.gap_text(a["gap_recovered"], a.get("gap_reason")), num(a["context_ratio"], ".2f"),
                     zreport.gate_text(a["gates"]), num(a["serial_seconds"], ".1f"), num(a["critical_seconds"], ".1f"),
                     f"{num(a['peak_rss_mib'], '.0f')} ({a['peak_task']})", f"{a['max_parallel']} of {a['tasks']}"])
    head = ["arm", "held-out CE", "layer-token passes", "student FLOPs", "teacher FLOPs", "total FLOPs", "peak lr", "gap recovered", "context use (x teacher)", "gates",
            "wall s (1 worker)", "wall s (enough workers)", "peak RSS MiB (task)", "tasks at once"]
    searched = search_lines(report)
    search = ("\n\nLearning-rate searches (zgcore.training.lr_search; each candidate at its arm's full budget; blocks scored "
              "by their validation loss, end-to-end arms by held-out CE, both on the validation sequences outside the "
              "test subset the table's CE is measured on — no lr is chosen on a test sequence; the reported run is its "
              "own search's chosen candidate, so its run-level luck helped choose it: a selection bias a study over "
              "seeds measures against the other seeds):\n\n"
              + "\n".join(searched)) if searched else ""
    return (f"# Distillation study: {report['name']}\n\n" + banner(report) + f"Teacher `{report['teacher']}`; held-out CE (nats/token) of the "
            f"teacher {num(report['ce_teacher'])}, of the untrained student {num(report['ce_untrained'])} "
            f"({report['student_layers']} of the teacher's layers); {report['val_tokens']:,} held-out tokens.\n\n"
            + table(head, rows) + "\n\n" + MATCHING + " " + FLOPS_NOTE + f" Here: {report['e2e_steps']} end-to-end steps of "
            f"{report['e2e_batch']} sequences for (b), {report.get('e2e_healed_steps', '—')} for (d)." + search
            + "\n\nWall times are the tasks' own measured training (and, for (a) and (c), "
            "cache-building) times; assembling and evaluating are left out. Peak RSS is each task's own peak "
            "resident memory (the kernel's high-water mark reset at the task's start).\n" + extra_md(report)
            + comparisons_md(report))


def seeds_report(name: str, seeds: Sequence[int], reports: Sequence[Mapping[str, Any]],
                 scores: Sequence[Mapping[str, Any]], groups: Any = None) -> dict[str, Any]:
    """The distillation study over several seeds (each seed: its own blocks, end-to-end student
    and healing; one teacher cache).

    Args:
        seeds: the seeds, in order. reports: each seed's study report (:func:`markdown`'s input).
        scores: per seed, arm name -> per-sequence held-out CE ``[n]`` (nats/token), the same sequences for all.
        groups: ``[n]`` document id of each sequence (resampled within runs), or None.

    Returns:
        ``{"name", "seeds", "arms": [{"name", "label", "ce": [per seed], "ce_mean", "ce_std",
        "gap_recovered": [per seed], "passes": [per seed]}], "comparisons" (pooled over seeds),
        "findings" (sentences), "ce_teacher", "teacher", "searches": {seed: [lines]}}`` — ``searches``:
        each seed's own lr searches (:func:`search_lines`: every lr tried with its score, the choice),
        empty where nothing was searched.

    How a searched arm avoids selection bias (the issue of reporting a search's own winner): each
    seed searches its own lr and its reported run is that search's chosen candidate, so the
    compared unit is the whole procedure "search, then train" and the selection's luck is part of
    the run-to-run spread that a method comparison's interval measures (never shared between runs).
    """
    from zgcore.evaluation.study import mean_std

    names = [a["name"] for a in reports[0]["arms"]]
    arms = []
    for n in names:
        per = [next(a for a in r["arms"] if a["name"] == n) for r in reports]
        m, sd = mean_std([a["ce"] for a in per])
        arms.append({"name": n, "label": ARMS.get(n, n), "ce": [a["ce"] for a in per], "ce_mean": m, "ce_std": sd,
                     "gap_recovered": [a["gap_recovered"] for a in per], "passes": [a["passes"] for a in per],
                     "flops": [(a.get("flops") or {}).get("total") for a in per]})
    comps = comparisons({n: {s: sc[n] for s, sc in zip(seeds, scores)} for n in names}, groups=groups)
    plumbing = any(r.get("descriptive") for r in reports)
    if plumbing:
        from zgcore.evaluation.compare import descriptive

        descriptive(comps)
    return {"name": name, "teacher": reports[0]["teacher"], "seeds": list(seeds), "ce_teacher": reports[0]["ce_teacher"],
            "arms": arms, "comparisons": comps, "findings": findings(comps), "descriptive": plumbing, "seed_varies": SEEDS_VARY,
            "searches": {str(s): search_lines(r) for s, r in zip(seeds, reports) if search_lines(r)}}


def seeds_markdown(rep: Mapping[str, Any]) -> str:
    """:func:`seeds_report` as Markdown: per arm its CE per seed and mean ± std, then the comparisons."""
    rows = [[a["label"], ", ".join(num(x) for x in a["ce"]), f"{num(a['ce_mean'])} ± {num(a['ce_std'])}",
             ", ".join(zreport.gap_text(g) for g in a["gap_recovered"]), ", ".join(f"{p:,}" for p in a["passes"]),
             ", ".join(num(f, ".3e") for f in a.get("flops") or [])] for a in rep["arms"]]
    return (f"# Distillation study over seeds {rep['seeds']}: {rep['name']}\n\n" + banner(rep) + f"Teacher `{rep['teacher']}`, "
            f"held-out CE {num(rep['ce_teacher'])} nats/token. Each seed trains its own blocks, end-to-end student and healing "
            f"on one teacher cache ({rep.get('seed_varies') or SEEDS_VARY}); per-seed reports carry the timings and the "
            "lr searches.\n\n"
            + table(["arm", "held-out CE per seed", "mean ± std", "gap recovered per seed", "layer-token passes",
                     "total FLOPs per seed"], rows)
            + "\n" + comparisons_md(rep) + seeds_search_md(rep))


def seeds_search_md(rep: Mapping[str, Any]) -> str:
    """The per-seed lr searches of :func:`seeds_report` as Markdown ("" when nothing was searched)."""
    if not rep.get("searches"):
        return ""
    return ("\n\n## Learning-rate searches, per seed\n\nPer-seed searches: each seed searches its own lrs (on the "
            "tuning sequences, never the test subset) and reports the chosen candidate's run, so each reported run is "
            "one whole 'search, then train' procedure and the choice's luck is inside the run-to-run spread the "
            "comparisons measure (no run is shared between the tuning and the reported results of two seeds).\n\n"
            + "\n\n".join(f"Seed {s}:\n\n" + "\n".join(lines) for s, lines in rep["searches"].items()))
