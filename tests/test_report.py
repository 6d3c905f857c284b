"""Figures that cannot lie: the gap recovered is defined only when the teacher beats the untrained
student by a margin; the quality gate fails when it is undefined or the student got worse; a
non-finite figure is named in every report instead of crashing it."""
import math

import pytest

from zgcore.evaluation import report as zr
from zgcore.evaluation.study import objective_study, seed_markdown, seed_summary, study_markdown

EVAL = {"gate_gap": 0.8, "gate_context": 0.8}


def measured(teacher_ce, untrained_ce, student_ce, spec="smollm2-135m", cu_student=1.0, cu_teacher=1.2):
    cu = {k: {"full": 3.0, "window": 3.0 + v, "context_use": v}
          for k, v in (("teacher", cu_teacher), ("untrained", 0.5), ("student", cu_student))}
    return {"name": "t", "teacher": spec, "boundaries": [0, 2, 4], "seq_len": 32, "val_sequences": 2, "val_tokens": 64,
            "cross_entropy": {"teacher": teacher_ce, "untrained": untrained_ce, "student": student_ce},
            "layers": {"teacher": 4, "untrained": 2, "student": 2}, "context_use": cu, "context_window": 8,
            "context_sequences": 2, "model_dir": "m", "sample": "",
            "blocks": [{"block": 0, "start": 0, "end": 2, "kept": [0], "objective": "clean", "steps": 3,
                        "first_loss": 1.0, "final_loss": 0.5, "seconds": 1.0}]}


def test_gap_and_gates_on_a_real_gap():
    rep = zr.experiment_report(measured(2.8646, 5.0868, 3.0187), EVAL)
    assert rep["gap_recovered"] == pytest.approx((5.0868 - 3.0187) / (5.0868 - 2.8646))
    assert rep["gates"]["quality"]["passed"] and rep["gates"]["context"]["passed"]
    assert rep["teacher_note"] is None
    assert "**93.1%**" in zr.report_markdown(rep)


def test_untrained_better_than_teacher_leaves_the_gap_and_the_quality_gate_undefined():
    # the tiny-preset figures: untrained 5.5093 < teacher; the old formula said 90.3% PASS
    rep = zr.experiment_report(measured(5.5400, 5.5093, 5.5248, spec="tiny-llama"), EVAL)
    assert rep["gap_recovered"] is None and "not better than the untrained student" in rep["gap_reason"]
    q = rep["gates"]["quality"]
    assert q["passed"] is None and q["value"] is None and q["reason"].startswith("undefined: ")
    assert zr.gate_text(rep["gates"]).startswith("quality undefined")  # as the context gate says it, never FAIL
    md = zr.report_markdown(rep)
    assert "**undefined**" in md and "plumbing checks" in md and "%" not in md.split("## Context use")[0]
    # a gap narrower than the margin is undefined too
    assert zr.gap_recovered(5.0, 4.99, 5.0 - zr.GAP_MARGIN / 2)[0] is None


def test_a_student_worse_than_the_untrained_one_fails_the_gate():
    rep = zr.experiment_report(measured(2.86, 5.08, 5.50), EVAL)
    assert rep["gap_recovered"] < 0
    assert not rep["gates"]["quality"]["passed"]
    # even with a threshold that a negative share would meet
    assert not zr.experiment_report(measured(2.86, 5.08, 5.50), {**EVAL, "gate_gap": -10})["gates"]["quality"]["passed"]


def test_gates_flip_at_their_thresholds():
    ok = zr.experiment_report(measured(2.0, 4.0, 2.4, cu_student=0.8, cu_teacher=1.0), EVAL)  # exactly 80% / 0.8x
    assert ok["gates"]["quality"]["passed"] and ok["gates"]["context"]["passed"]
    assert not zr.experiment_report(measured(2.0, 4.0, 2.4002), EVAL)["gates"]["quality"]["passed"]
    assert not zr.experiment_report(measured(2.0, 4.0, 2.4, cu_student=0.7999, cu_teacher=1.0), EVAL)["gates"]["context"]["passed"]
    neg = zr.experiment_report(measured(2.0, 4.0, 2.4, cu_student=-0.1, cu_teacher=1.0), {**EVAL, "gate_context": -1.0})
    assert not neg["gates"]["context"]["passed"]  # negative context use never passes


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_figures_are_named_not_crashed_on(bad):
    m = measured(2.86, 5.08, bad)
    m["blocks"][0]["final_loss"] = bad
    m["context_use"]["student"]["context_use"] = bad
    rep = zr.experiment_report(m, EVAL)
    assert rep["gap_recovered"] is None and "not finite" in rep["gap_reason"]
    assert not rep["gates"]["quality"]["passed"] and not rep["gates"]["context"]["passed"]
    md = zr.report_markdown(rep)
    assert "(not finite)" in md and md.count("(not finite)") >= 3  # student CE, its context use, a block's loss


def test_seed_summary_and_study_never_average_or_pass_an_undefined_gap():
    good = zr.experiment_report(measured(2.86, 5.08, 3.0), EVAL)
    tiny = zr.experiment_report(measured(5.54, 5.5093, 5.5248, spec="tiny-llama"), EVAL)
    s = seed_summary([good, tiny], [0, 1])
    assert s["all_gates_passed"] is None and "gap_recovered" not in s["aggregate"]  # one seed's gates are undefined
    assert "seed(s) [1]" in s["undefined"]["gap_recovered"]
    md = seed_markdown(s, "x")
    assert "undefined" in md and "plumbing checks" not in md  # the note comes from the first seed's teacher
    s2 = seed_summary([tiny, tiny], [0, 1])
    assert "plumbing checks" in seed_markdown(s2, "x") and "quality undefined" in seed_markdown(s2, "x")
    arms = [{"objective": "clean", "targets": "cached", "seed": 0, "report": tiny, "block_files": []}]
    st = objective_study(arms)
    assert st["rows"][0]["gap_recovered"] is None and st["rows"][0]["gates"]["quality"] is None
    smd = study_markdown(st)
    assert "undefined" in smd and "quality undefined" in smd and "FAIL" not in smd and "plumbing checks" in smd
    assert "not compared" in smd and "byte for byte:" not in smd  # no online arm: no empty list under a heading
    both = arms + [{**arms[0], "targets": "online"}]
    assert "- clean/s0: identical" in study_markdown(objective_study(both))  # no files on either side: equal
    at = {**arms[0], "objective": "attention_transfer", "report": {**tiny, "blocks": [
        {**b, "objective": "attention_transfer", "first_loss": 4.0, "final_loss": 0.1} for b in tiny["blocks"]]}}
    st2 = objective_study(arms + [at])
    assert st2["rows"][0]["local_reduction"] == [pytest.approx(0.5)]  # clean: 1.0 -> 0.5, one quantity
    assert st2["rows"][1]["local_reduction"] == [None]  # attention error -> boundary error: not a reduction
    assert "97.50%" not in study_markdown(st2) and "do not measure one thing" in study_markdown(st2)


def test_economics_projects_the_other_mode_from_measured_times():
    man = {"build_seconds": 10.0, "bytes": 2**20, "n_train": 8, "n_val": 2}
    blocks = [{"block": 0, "start": 0, "end": 2, "targets": "cached", "steps": 5, "seconds": 6.0, "data_seconds": 1.0,
               "compute_seconds": 5.0, "teacher_seconds": 0.0}]
    calls = []
    econ = zr.economics(man, blocks, [4], lambda s, e, b: calls.append((s, e, b)) or 0.5)
    assert calls == [(0, 2, 4)]
    job = econ["per_job"][0]
    assert job["cached_seconds"] == 6.0 and job["online_seconds"] == pytest.approx(5.0 + 5 * 0.5)
    assert econ["break_even_reuses"] == math.floor(10.0 / 1.5) + 1
    assert econ["build_seconds_per_sequence"] == pytest.approx(1.0)


def test_healing_flops_count_the_teacher_online_each_step_or_once_for_its_store():
    from zgcore.evaluation.flops import heal_flops

    teacher = {"layers": [100, 100], "head": 50, "width": 4}
    student = {"layers": [100], "head": 50, "width": 4}
    t_full, s_full = 2 * (2 * 100 + 2 * 8 * 4) + 2 * 50, (2 * 100 + 2 * 8 * 4) + 2 * 50  # per token, T = 8
    online = heal_flops(8, teacher, student, steps=3, batch_size=2)
    assert online["student"] == 3 * 3 * 2 * 8 * s_full and online["teacher"] == 3 * 2 * 8 * t_full
    cached = heal_flops(8, teacher, student, steps=3, batch_size=2, store_sequences=10)
    assert cached["teacher"] == 10 * 8 * t_full and cached["student"] == online["student"]
    assert cached["total"] == cached["student"] + cached["teacher"] and "store" in cached["teacher_mode"]


def test_budgets_are_never_written_in_scientific_notation():
    from tasks.library import SelectBudget
    from zgcore.evaluation.library_report import budget_label

    assert budget_label(84_962_765.0) == "84,962,765" and budget_label(0.7) == "0.7"
    t = SelectBudget(candidates=[], budget=84_962_765.0, unit="params", outputs="/tmp/unused")
    assert t.label() == "select-params84962765" and "e+" not in t.label()
