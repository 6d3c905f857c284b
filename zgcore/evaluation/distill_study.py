"""The distillation study's report, joined from its four arms' outputs (what the
``DistillStudyReport`` task asks for in one call, :func:`study_report`): blockwise, end to end,
blockwise then healing, and end to end at the blockwise + healing budget, each with its held-out
CE, the student layer-token passes it spent, its stages' time and memory, and its lr.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping, Sequence

from zgcore.evaluation import distill_report
from zgcore.evaluation.compare import descriptive as describe_only
from zgcore.evaluation.flops import add_flops
from zgcore.evaluation.report import plumbing_check

E2E_ARMS = ("e2e", "e2e_healed")  # the end-to-end arms, by name


@dataclass(frozen=True)
class StudyInputs:
    """What the study's report is joined from (plain data, read from the arms' outputs).

    Attributes:
        name, teacher: the study's name and the teacher's spec.
        eval, heal, distill: the experiment's eval, heal and distill sections.
        train: each block's resolved train settings (``seed``, ``batch_size``), in block order.
        blockwise, healed: the ``report.json`` of the experiment's evaluations without and with healing.
        heal_metrics: the healing stage's ``metrics.json``.
        e2e: per end-to-end arm (:data:`E2E_ARMS`) ``(eval.json, metrics.json, {"lr", "search"?})``.
        block_lrs: each block's ``{"lr", "search"?}``.
        scores: each arm's per-sequence held-out CE (nats/token); rows, docs: the rows scored and their documents.
        untrained: the untrained student's per-sequence CE on those rows.
        cache: the boundary store's manifest when the blocks read one, else ``None``.
    """
    name: str
    teacher: str
    eval: Mapping[str, Any]
    heal: Mapping[str, Any]
    distill: Mapping[str, Any]
    train: Sequence[Mapping[str, Any]]
    blockwise: Mapping[str, Any]
    healed: Mapping[str, Any]
    heal_metrics: Mapping[str, Any]
    e2e: Mapping[str, tuple]
    block_lrs: Sequence[Mapping[str, Any]]
    scores: Mapping[str, Any]
    rows: Any
    docs: Any
    untrained: Any
    cache: Mapping[str, Any] | None = None


def study_report(inp: StudyInputs) -> dict[str, Any]:
    """The study's report: the four arms (:func:`zgcore.evaluation.distill_report.arm`, with their FLOPs,
    :func:`zgcore.evaluation.flops.add_flops`, and verdict gates), the ``eval.extra`` rows, the
    paired comparisons over held-out sequences (descriptive only for a random teacher) and the step counts."""
    a, c, heal = inp.blockwise, inp.healed, inp.heal_metrics
    stages = []
    if inp.cache is not None:
        stages.append([{"task": "TeacherBoundary", "seconds": inp.cache["build_seconds"],
                        "peak_rss_mib": inp.cache.get("peak_rss_mib")}])
    stages.append([{"task": f"TrainBlock {m['block']}", "seconds": m["seconds"], "peak_rss_mib": m.get("peak_rss_mib")}
                   for m in a["blocks"]])
    seq = int(a["seq_len"])
    block_passes = sum(m["steps"] * int(t["batch_size"]) * len(m["kept"]) for m, t in zip(a["blocks"], inp.train)) * seq
    e2e, e2e_h = inp.e2e["e2e"][1], inp.e2e["e2e_healed"][1]
    L = e2e["student_layers"]
    heal_stage = [{"task": "Heal", "seconds": heal["seconds"], "peak_rss_mib": heal["peak_rss_mib"]}]
    ce_u, ce_t = a["cross_entropy"]["untrained"], a["cross_entropy"]["teacher"]
    g = (float(inp.eval["gate_gap"]), float(inp.eval["gate_context"]))
    t_cu = (a.get("context_use") or {}).get("teacher")
    blr = {f"block {i}": x for i, x in enumerate(inp.block_lrs)}
    arms = [
        distill_report.arm("blockwise", a["cross_entropy"]["student"], ce_u, ce_t, a.get("context_use"), *g, stages,
                           block_passes, lrs=blr),
        _e2e_arm(inp, "e2e", ce_u, ce_t, t_cu, g, seq),
        distill_report.arm("healed", c["cross_entropy"]["student"], ce_u, ce_t, c.get("context_use"), *g,
                           stages + [heal_stage], block_passes + heal["steps"] * int(inp.heal["batch_size"]) * seq * L,
                           lrs={**blr, "heal": {"lr": float(inp.heal["lr"])}}),
        _e2e_arm(inp, "e2e_healed", ce_u, ce_t, t_cu, g, seq),
    ]
    rep = {"name": inp.name, "teacher": inp.teacher, "ce_teacher": ce_t, "ce_untrained": ce_u, "arms": arms,
           "student_layers": L, "val_tokens": a["val_tokens"], "e2e_steps": e2e["steps"],
           "e2e_healed_steps": e2e_h["steps"], "heal_steps": int(inp.heal["steps"]),
           "e2e_batch": int(inp.distill["batch_size"]), "matched_steps": e2e["matched_steps"]}
    e2e_extra = {k: inp.e2e[k][0].get("extra") or [] for k in E2E_ARMS}
    rep["extra"] = distill_report.extra_rows({"blockwise": a.get("extra") or [], "healed": c.get("extra") or [],
                                              **e2e_extra}, a.get("extra") or [])
    seed = int(inp.train[0]["seed"])
    rep["seeds"] = [seed]
    rep["comparisons"] = distill_report.comparisons({k: {seed: v} for k, v in inp.scores.items()}, groups=inp.docs)
    rep["descriptive"] = plumbing_check(inp.teacher)
    if rep["descriptive"]:
        describe_only(rep["comparisons"])
    bs = int(inp.distill["batch_size"])
    add_flops(arms, seq, a, [int(t["batch_size"]) for t in inp.train],
              {"e2e": (e2e["steps"], bs), "e2e_healed": (e2e_h["steps"], bs),
               "healed": (int(inp.heal["steps"]), int(inp.heal["batch_size"]))}, inp.cache)
    distill_report.verdict_gates(arms, inp.scores, inp.untrained, seed, groups=inp.docs,
                                 descriptive=rep["descriptive"])  # needs a verdict
    return rep


def _e2e_arm(inp: StudyInputs, name: str, ce_u: float, ce_t: float, t_cu, g: tuple[float, float], seq: int) -> dict:
    """An end-to-end arm's entry from its evaluation (``eval.json``) and its training metrics."""
    b, m, lr = inp.e2e[name]
    stage = {"task": "DistillE2E", "seconds": m["seconds"], "peak_rss_mib": m["peak_rss_mib"]}
    return distill_report.arm(name, b["ce"], ce_u, ce_t,
                              {"teacher": t_cu, "student": b["context_use"]} if t_cu and b["context_use"] else None,
                              *g, [[stage]],
                              m["steps"] * int(inp.distill["batch_size"]) * seq * m["student_layers"],
                              lrs={"e2e": lr})
