"""Report assembly: the gap recovered and when it is defined, the quality and context gates, the
cache economics, and the experiment report (``report.json`` dict and ``report.md``).

Measurement (cross-entropy, context use, boundary shift, timing a teacher forward) lives in
:mod:`zgcore.evaluation.metrics`; this module only combines measured figures and renders them, with
:func:`zgcore.markdown.table` and :func:`zgcore.markdown.num` so that a missing or non-finite figure
is shown as such instead of crashing the report.

Source: ZeroGraph (arXiv:2611.02200), quality and context-use gates, cache economics.
"""
from __future__ import annotations

import math
from typing import Any
from collections.abc import Mapping

import numpy as np

from zgcore.evaluation.economics import (cache_economics, economics, economics_md, logit_store_cost,  # noqa: F401
                                          logit_store_md)
from zgcore.markdown import num, table

# The untrained -> teacher gap must be at least this wide (held-out CE, nats/token) for a share of
# it to mean anything. Below it — the tiny presets' random teachers sit at ln(260) like their
# untrained students — the share divides by noise, flips sign and reads as e.g. "107% recovered".
GAP_MARGIN = 0.05
# The teacher's own context use (nats/token of CE that context beyond the window removes) must reach this
# floor for a student's share of it to mean anything: a random teacher's sits near 0 and the ratio divides by noise.
CONTEXT_FLOOR = 0.01

RANDOM_TEACHER_NOTE = ("The teacher `{spec}` is a tiny randomly initialised model: these figures are plumbing "
                       "checks of the pipeline, not results.")


def _finite(*xs: Any) -> bool:
    return all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in xs)


def random_teacher_note(spec: str) -> str | None:
    """The sentence every report of a random (``tiny-*``) teacher carries, or ``None`` for a real one."""
    from zgcore.models.teacher import TINY_FAMILIES

    return RANDOM_TEACHER_NOTE.format(spec=spec) if spec in TINY_FAMILIES else None


def plumbing_check(spec: str) -> bool:
    """True for a study whose teacher (or tokenizer) is a tiny random model (``tiny-*``: the smoke
    presets ``tiny``, ``distill_tiny``, ``local_tiny``): its report describes, never concludes."""
    from zgcore.models.teacher import TINY_FAMILIES

    return spec in TINY_FAMILIES


def gap_recovered(ce_untrained: float, ce_student: float, ce_teacher: float,
                  margin: float = GAP_MARGIN) -> tuple[float | None, str | None]:
    """Share of the held-out CE gap between the untrained student and the teacher that training closed.

    Args:
        ce_untrained, ce_student, ce_teacher: held-out cross-entropy in nats/token.
        margin: the smallest ``ce_untrained - ce_teacher`` (nats/token) for which the share is defined.

    Returns:
        ``(share, None)`` with ``share = (ce_untrained - ce_student) / (ce_untrained - ce_teacher)``
        (1.0 = teacher level, negative = training made the student worse), or ``(None, reason)``
        when it is undefined: a figure is not finite, or the teacher is not better than the
        untrained student by ``margin``.
    """
    if not _finite(ce_untrained, ce_student, ce_teacher):
        return None, "a cross-entropy is not finite"
    gap = ce_untrained - ce_teacher
    if gap < margin:
        return None, (f"the teacher (CE {ce_teacher:.4f}) is not better than the untrained student "
                      f"(CE {ce_untrained:.4f}) by the margin of {margin} nats/token, so there is no gap to recover")
    return (ce_untrained - ce_student) / gap, None


def gates(report: Mapping[str, Any], gap_threshold: float = 0.8, context_threshold: float = 0.8) -> dict[str, Any]:
    """Pass/fail quality gates, each with its threshold, measured value and (on failure) why.

    * ``quality``: **undefined** (``"passed": None``) when the gap is undefined (:func:`gap_recovered`),
      else PASS when the assembled student is better than
      the untrained one (when ``report["comparisons"]`` has ``student`` vs ``untrained``: its
      verdict is ``"a better"``, :mod:`zgcore.evaluation.compare`), and it recovers at least ``gap_threshold`` of the gap.
    * ``context``: the student's context use is finite, positive and at least ``context_threshold``
      times the teacher's; **undefined** (``"passed": None``, neither PASS nor FAIL) when the
      teacher's own context use is not finite or below :data:`CONTEXT_FLOOR` nats/token.

    Args:
        report: needs ``cross_entropy`` (``teacher``, ``untrained``, ``student``; nats/token),
            ``gap_recovered`` (share or ``None``), ``gap_reason``, and optionally ``context_use``
            (``{"teacher": {"context_use": ..}, "student": {..}}``).
    """
    g, ce = report["gap_recovered"], report["cross_entropy"]
    reason = report.get("gap_reason")
    vs = next((c for c in report.get("comparisons") or [] if (c["a"], c["b"]) == ("student", "untrained")), None)
    if g is None:  # like the context gate: a gate that cannot be judged is neither PASS nor FAIL
        passed, reason = None, f"undefined: {reason}"
    elif vs is not None and vs["verdict"] != "a better":
        from zgcore.evaluation.compare import sentence

        passed, reason = False, f"the assembled student is not shown better than the untrained one: {sentence(vs)}"
    elif not ce["student"] < ce["untrained"]:
        passed, reason = False, "the assembled student is not better than the untrained one"
    else:
        passed = bool(g >= gap_threshold)
        reason = None if passed else f"recovered {num(g, '.1%')} < {gap_threshold:.0%}"
    out = {"quality": {"value": g, "threshold": gap_threshold, "passed": passed, "reason": reason}}
    cu = report.get("context_use")
    if cu:
        s, t = cu["student"]["context_use"], cu["teacher"]["context_use"]
        if not (_finite(t) and t >= CONTEXT_FLOOR):
            out["context"] = {"value": None, "student": s, "teacher": t, "threshold": context_threshold, "passed": None,
                              "reason": f"undefined: the teacher's own context use ({num(t, '.4f')} nats/token) is below "
                                        f"the floor {CONTEXT_FLOOR} (a teacher that uses no context has no share to match)"}
            return out
        ok = _finite(s)
        passed = bool(ok and s > 0 and s >= context_threshold * t)
        out["context"] = {"value": s / t if ok else None, "student": s, "teacher": t, "threshold": context_threshold,
                          "passed": passed,
                          "reason": None if passed else ("the student's context use is not finite"
                                                         if not ok else "student context use below the threshold")}
    return out


def model_comparisons(scores: Mapping[str, Any], seed: int, extra: Mapping[str, Mapping[str, Any]] | None = None,
                      documents: Any = None) -> list[dict[str, Any]]:
    """The experiment's paired comparisons (:func:`zgcore.evaluation.compare.compare`): the assembled student
    against the untrained student and against the teacher, on the held-out split and then on every
    ``eval.extra`` corpus (their entries carry ``"held_out": name``).

    Args:
        scores: model key (``teacher``, ``untrained``, ``student``) -> per-sequence CE ``[n]`` (nats/token).
        seed: the experiment's training seed. extra: ``{name: part}`` as :func:`zgcore.evaluation.compare.scores_part`.
        documents: ``[n]`` document id of each held-out row (resampled as units), or None.

    Every entry compares two fixed models (``"unit": "sequence"``, :func:`zgcore.evaluation.compare.compare_arms`),
    resampling documents where the held-out text records them (``documents``; an extra corpus's part
    its ``"documents"``), else saying its sequences were treated as independent.
    """
    from zgcore.evaluation.compare import compare_arms

    pairs = [("student", "untrained"), ("student", "teacher")]
    out = compare_arms(pairs, {k: {seed: np.asarray(v, dtype=np.float64)} for k, v in scores.items()}, groups=documents,
                       methods=False)
    for name, part in (extra or {}).items():
        ce = {k: {seed: np.asarray(v, dtype=np.float64)} for k, v in part["ce"].items()}
        out += [{**c, "held_out": name} for c in compare_arms(pairs, ce, groups=part.get("documents"), methods=False)]
    return out


def experiment_report(measured: Mapping[str, Any], eval_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The experiment report from measured figures: perplexities, gap recovered (or why it is
    undefined), gates and the random-teacher note added to ``measured``.

    Args:
        measured: ``name``, ``teacher`` (spec), ``cross_entropy`` (``teacher``/``untrained``/``student``,
            nats/token), ``context_use``, optionally ``comparisons`` (:func:`zgcore.evaluation.compare.compare`
            entries; ``student`` vs ``untrained`` decides the quality gate) and ``extra`` (per
            ``eval.extra`` corpus its ``cross_entropy``; each gets its own gap recovered) and the
            rest of what :func:`report_markdown` shows.
        eval_cfg: the ``eval`` settings (``gate_gap``, ``gate_context``).
    """
    ce = measured["cross_entropy"]
    share, reason = gap_recovered(ce["untrained"], ce["student"], ce["teacher"])
    extra = [{**e, **dict(zip(("gap_recovered", "gap_reason"), gap_recovered(e["cross_entropy"]["untrained"],
                                                                          e["cross_entropy"]["student"],
                                                                          e["cross_entropy"]["teacher"])))}
             for e in measured.get("extra") or []]
    rep = {**measured, "extra": extra, "perplexity": {k: math.exp(v) if _finite(v) and v < 700 else None for k, v in ce.items()},
           "gap_recovered": share, "gap_reason": reason, "gap_margin": GAP_MARGIN,
           "teacher_note": random_teacher_note(measured["teacher"])}
    if rep["teacher_note"] and rep.get("comparisons"):  # a random teacher: a plumbing check, never a verdict
        from zgcore.evaluation.compare import descriptive

        rep["comparisons"] = descriptive([dict(c) for c in rep["comparisons"]])
    rep["gates"] = gates(rep, float(eval_cfg["gate_gap"]), float(eval_cfg["gate_context"]))
    return rep


def gap_text(share: float | None, reason: str | None = None) -> str:
    """The gap recovered as a report cell: ``"93.1%"`` or ``"undefined"`` (with ``reason`` if given)."""
    if share is None:
        return "undefined" + (f" ({reason})" if reason else "")
    return num(share, ".1%")


def gate_text(gates_: Mapping[str, Mapping[str, Any]]) -> str:
    """``"quality PASS, context FAIL"`` (``undefined`` for a gate whose ``passed`` is None) for a report cell."""
    return ", ".join(f"{k} {verdict_word(v['passed'])}" for k, v in gates_.items())


def verdict_word(passed: bool | None) -> str:
    """``PASS``, ``FAIL``, or ``undefined`` (``None``: the gate cannot be judged)."""
    return "undefined" if passed is None else "PASS" if passed else "FAIL"


def summary_line(report: Mapping[str, Any]) -> str:
    """One line for the terminal: the three cross-entropies and the gap recovered."""
    ce = report["cross_entropy"]
    line = (f"held-out CE (nats/token): teacher {num(ce['teacher'])} | untrained student {num(ce['untrained'])} | "
            f"assembled student {num(ce['student'])} | gap recovered {gap_text(report['gap_recovered'])}")
    for e in report.get("extra") or []:
        line += f"\n  out of domain, {e['name']}: student CE {num(e['cross_entropy']['student'])} | gap recovered " \
                f"{gap_text(e['gap_recovered'])}"
    return line


MODELS = (("teacher", "teacher"), ("untrained", "untrained student"), ("student", "assembled student"))


def _shift_md(shift: Mapping[str, Any]) -> list[str]:
    rows = [[r["block"], num(r["teacher_input"]), num(r["student_input"])] + [num(r["noisy_input"][str(s)]) for s in shift["scales"]]
            for r in shift["blocks"]]
    lines = ["## Boundary shift", "",
             "Each block's output error (channel-normalised MSE vs the teacher's next boundary) on the teacher's "
             "inputs, on the inputs the assembled student actually feeds it, and on noisy teacher inputs.", "",
             table(["block", "teacher input", "student-chain input"] + [f"noise {s}" for s in shift["scales"]], rows)]
    if shift.get("massive"):
        lines += ["", "Massive activations in the teacher's residual stream (why the loss is normalised per channel and "
                  "per position): " + "; ".join(f"b{m['boundary']}: sink/other norm {num(m['sink_norm_ratio'], '.1f')}x, "
                                                 f"top channel {num(m['top_channel_ratio'], '.1f')}x median"
                                                 for m in shift["massive"]) + "."]
    return lines + ["", "Drift of the assembled student's residual stream from the teacher's: "
                    + ", ".join(f"b{d['boundary']}: {num(d['relative_error'])}" for d in shift["drift"]), "",
                    "![drift](drift.png) ![loss curves](loss_curves.png)", ""]


def _extra_md(report: Mapping[str, Any]) -> list[str]:
    """The out-of-domain table: per ``eval.extra`` corpus, the three CEs and the gap recovered, beside in-domain."""
    extra = report.get("extra") or []
    if not extra:
        return []
    ce = report["cross_entropy"]
    rows = [["in-domain (held-out split of the training corpus)", report["val_sequences"], num(ce["teacher"]),
             num(ce["untrained"]), num(ce["student"]), gap_text(report["gap_recovered"])]]
    rows += [[f"{e['name']} (out of domain)", e["sequences"], num(e["cross_entropy"]["teacher"]),
              num(e["cross_entropy"]["untrained"]), num(e["cross_entropy"]["student"]),
              gap_text(e["gap_recovered"], e.get("gap_reason"))] for e in extra]
    return ["## In-domain and out-of-domain held-out text", "",
            "Each `eval.extra` corpus is tokenised with the teacher's tokenizer and never trained on (nats/token).", "",
            table(["held-out text", "sequences", "teacher CE", "untrained CE", "student CE", "gap recovered"], rows), ""]


def report_markdown(report: Mapping[str, Any]) -> str:
    """Render the experiment report (:func:`experiment_report`) as Markdown; every figure through
    :func:`zgcore.markdown.num`, so a missing or non-finite one is named, never a crash."""
    ce = report["cross_entropy"]
    lines = [f"# ZeroGraph report — {report['name']}", ""]
    if report.get("teacher_note"):
        lines += [f"**{report['teacher_note']}**", ""]
    lines += [f"Teacher: `{report['teacher']}`; boundaries {report['boundaries']}; "
              f"{report['val_tokens']} held-out tokens ({report['val_sequences']} sequences x {report['seq_len']}).", "",
              table(["model", "layers", "held-out CE (nats/token)", "perplexity"],
                    [[label, report["layers"][k], num(ce[k]), num(report["perplexity"].get(k), ".2f")] for k, label in MODELS]), ""]
    if report.get("heal_steps"):
        lines += [f"The assembled student was healed ({report['heal_steps']} steps of end-to-end logit distillation, "
                  "`heal.steps`) before evaluation: its row is the healed model.", ""]
    if report["gap_recovered"] is None:
        lines += [f"Gap recovered by training: **undefined**: {report.get('gap_reason')}.", ""]
    else:
        lines += [f"Gap recovered by training: **{gap_text(report['gap_recovered'])}** "
                  "of the held-out CE gap between the untrained student and the teacher.", ""]
    sub = report.get("subset")
    if sub and sub["sequences"] < sub["of"]:
        lines += [f"Scored on a random subset of {sub['sequences']} of the {sub['of']} held-out sequences "
                  f"(eval.max_sequences, eval.subset_seed={sub['seed']}; rows sha256 `{sub['sha256'][:16]}`).", ""]
    lines += _extra_md(report)
    if report.get("comparisons"):
        from zgcore.evaluation.compare import markdown as comparisons_md, sentence

        lines += ["## Comparisons", "", comparisons_md(report["comparisons"]), ""]
        lines += [f"- {sentence(c)}" + (f" [{c['held_out']}]" if c.get("held_out") else "") for c in report["comparisons"]]
        lines += [""]
    cu = report.get("context_use")
    if cu:
        lines += [f"## Context use (W = {report['context_window']} tokens, {report['context_sequences']} sequences)", "",
                  "CE on the second half of each sequence with only the last W tokens visible, minus the same with full "
                  "context (nats/token; positive = the model uses its context).", "",
                  table(["model", "CE full context", "CE last W tokens", "context use"],
                        [[label, num(cu[k]["full"]), num(cu[k]["window"]), num(cu[k]["context_use"], "+.4f")]
                         for k, label in MODELS]), ""]
    if report.get("economics"):
        lines += economics_md(report["economics"], report["layers"]["teacher"])
    if report.get("logit_store"):
        lines += logit_store_md(report["logit_store"])
    if report.get("shift"):
        lines += _shift_md(report["shift"])
    if report.get("gates"):
        desc = {"quality": "share of CE gap recovered", "context": "student / teacher context use"}
        lines += ["## Gates", "", table(["gate", "value", "threshold", "result", "why"],
                                        [[f"{k} ({desc.get(k, k)})", num(g["value"], ".3f"), g["threshold"],
                                          verdict_word(g["passed"]), g.get("reason") or ""]
                                         for k, g in report["gates"].items()]), ""]
    conv = any("mixer" in b for b in report["blocks"])  # a converted student names every block's mixer (zgcore.models.mixers)
    lines += ["## Blocks", "", table(["block", "teacher layers", "student layers (from teacher)", *(["mixer"] if conv else []), "objective",
                                      "steps", "first loss", "final loss", "seconds"],
                    [[b["block"], f"[{b['start']}, {b['end']})", b["kept"], *([b.get("mixer", "softmax")] if conv else []), b["objective"],
                      b["steps"], num(b["first_loss"]), num(b["final_loss"]), num(b["seconds"], ".1f")] for b in report["blocks"]]),
              "", f"Assembled model: `{report['model_dir']}` (loads with `AutoModelForCausalLM.from_pretrained`{', trust_remote_code=True' * conv}).", ""]
    if report.get("sample"):
        lines += ["## Sample", "", "```", report["sample"], "```", ""]
    return "\n".join(lines)
