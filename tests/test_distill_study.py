"""DistillStudy: blockwise vs end-to-end vs blockwise + healing on one tiny teacher."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from zgcore.checks import ConfigError


def test_distill_study_reuses_the_experiment_and_matches_the_budget(tmp_path, run_graph):
    from workflows import build_experiment, load_config
    from workflows.distill import build_distill_study

    cfg = load_config("", "", "distill_tiny")
    ok, ran = run_graph(build_experiment(cfg, str(tmp_path)))  # a finished experiment (no healing: heal applies to it too)
    assert ok
    cfg_plain = load_config("", "heal.steps=0", "distill_tiny")
    ok, _ = run_graph(build_experiment(cfg_plain, str(tmp_path)))
    assert ok
    study = build_distill_study(cfg, str(tmp_path))
    ok, ran = run_graph(study)
    assert ok
    families = [f for f, _ in ran]
    # the blockwise arm, its cache and the healed arm were already done: only the new arm and the report run
    assert "TrainBlock" not in families and "TeacherBoundary" not in families and "Heal" not in families
    assert sorted(families) == ["DistillE2E", "DistillE2E", "DistillStudyReport", "EvaluateStudent", "EvaluateStudent"]
    rep = json.loads((study.out_dir / "report.json").read_text())
    arms = {a["name"]: a for a in rep["arms"]}
    assert set(arms) == {"blockwise", "e2e", "healed", "e2e_healed"}
    # (d): blockwise + healing passes, 48 + 3 steps x 2 sequences x 2 layers = 60 layer-sequence passes, in
    # ceil(60 / (4 x 2)) = 8 end-to-end steps (healing against end to end at equal passes)
    assert rep["e2e_healed_steps"] == 8 and arms["e2e_healed"]["passes"] == 8 * 4 * 2 * 32
    assert 0 <= arms["e2e_healed"]["passes"] - arms["healed"]["passes"] < 4 * 2 * 32
    # every arm states its lr (none searched here)
    assert arms["e2e"]["lrs"] == arms["e2e_healed"]["lrs"] == {"e2e": {"lr": 1e-3}}
    assert arms["blockwise"]["lrs"] == {"block 0": {"lr": 1e-3}, "block 1": {"lr": 1e-3}}
    assert arms["healed"]["lrs"] == {**arms["blockwise"]["lrs"], "heal": {"lr": 1e-3}}
    # 2 blocks x 6 steps x 4 sequences x 1 layer = 48 layer-sequence passes = 6 e2e steps x 4 x 2 layers
    assert rep["e2e_steps"] == rep["matched_steps"] == 6 and rep["student_layers"] == 2
    assert arms["e2e"]["passes"] == arms["blockwise"]["passes"] == 48 * 32
    assert arms["healed"]["passes"] == 48 * 32 + 3 * 2 * 32 * 2
    assert arms["blockwise"]["max_parallel"] == 2 and arms["e2e"]["max_parallel"] == 1 and arms["healed"]["tasks"] == 4
    for a in arms.values():
        assert a["peak_rss_mib"] > 0 and a["serial_seconds"] >= a["critical_seconds"] > 0
        assert a["ce"] > 0 and "quality" in a["gates"]
    ev = json.loads((study.requires()["blockwise"].out_dir / "report.json").read_text())
    assert arms["blockwise"]["ce"] == ev["cross_entropy"]["student"]
    md = (study.out_dir / "report.md").read_text()
    assert "(b) end-to-end distillation" in md and "layer-token pass" in md and "(d) end-to-end, (c)'s budget" in md
    assert [(c["a"], c["b"]) for c in rep["comparisons"]] == [("blockwise", "e2e"), ("healed", "e2e_healed"),
                                                               ("healed", "blockwise"), ("healed", "e2e"), ("e2e_healed", "e2e")]
    assert all({"mean_diff", "ci95", "seeds", "sequences", "verdict"} <= set(c) for c in rep["comparisons"])
    assert all(a["vs_untrained"]["b"] == "untrained student" for a in rep["arms"]) and "## Comparisons" in md
    # the e2e arm trained with the hidden-state term at the one interior boundary
    e2e = study.requires()["e2e"].requires()["model"]
    m = json.loads((e2e.out_dir / "metrics.json").read_text())
    assert m["pairs"] == [[1, 2]] and m["final_hidden"] >= 0
    assert (e2e.out_dir / "loss_log.csv").read_text().splitlines()[0] == "step,loss,kd,hidden,lr"


@pytest.mark.parametrize("over", ["train.init=random",
                                  # kept by measured influence, MLPs narrowed to the 32 largest channels of 64
                                  "train.keep=importance train.intermediate_size=32 train.importance_sequences=4"])
def test_e2e_student_starts_from_the_blockwise_init(over, tmp_path, run_graph):
    """Same kept layers, same MLP width, same initialisation: the e2e arm's starting layers are
    byte-identical to each TrainBlock's init.safetensors."""
    from workflows import load_config
    from workflows.distill import build_distill_study
    from zgcore.training import distill as zdistill

    cfg = load_config("", over, "distill_tiny")
    study = build_distill_study(cfg, str(tmp_path))
    blocks = study.requires()["blockwise"].block_tasks()
    ok, _ = run_graph(*blocks)
    assert ok
    _, (teacher, _) = blocks[0].load_teacher()
    e2e = study.requires()["e2e_model"]
    imp = e2e.requires().get("importance")
    assert (imp is None) == ("importance" not in over)
    measured = json.loads((imp.out_dir / "importance.json").read_text()) if imp else None
    student, pairs, passes = zdistill.initial_student(teacher, [0, 2, 4], list(study.blocks), 100, measured)
    if imp:
        assert student.config.intermediate_size == 32
    assert pairs == [(1, 2)] and [p[2] for p in passes] == [1, 1]
    layers = student.model.layers
    for i, b in enumerate(blocks):
        init = load_file(str(b.out_dir / "init.safetensors"))
        for k, v in init.items():
            assert torch.equal(layers[i].state_dict()[k.split(".", 2)[2]], v), k


@pytest.mark.parametrize("over,what", [("heal.steps=0", "heal.steps > 0"), ("distill.temperature=0", "distill.temperature"),
                                       ("distill.steps=-2", "distill.steps"), ("distill.hidden_weight=-1", "hidden_weight"),
                                       ("heal.grad_clip=-1", "heal.grad_clip"), ("distill.weight_decay=x", "distill.weight_decay"),
                                       ("blocks.0.intermediate_size=32", "one MLP width")])
def test_bad_study_settings_fail_at_construction(over, what):
    from workflows import DistillStudy

    with pytest.raises(ConfigError, match=what):
        DistillStudy(preset="distill_tiny", set=over)


def test_distill_study_over_seeds_compares_runs_reproducibly(tmp_path, run_graph):
    """seeds = [0, 1, 2]: one four-arm study per seed (one teacher cache), a report with every arm's
    CE per seed and method comparisons over the three training runs ("unit": "run", Holm-adjusted);
    the same study over seeds [0, 1] (its per-seed studies reused) resolves nothing (fewer than 3
    runs); a per-seed report's method comparisons have one run each; the fixed-model comparisons
    (each arm vs the untrained student) are over sequences; rebuilt, the report is the same bytes."""
    import shutil

    from workflows import load_config
    from workflows.distill import build_distill_study

    extra = 'eval.extra=[{"source":"stdlib-docstrings","max_tokens":2048}]'
    cfg = load_config("", "seeds=[0,1,2] eval.max_sequences=6 " + extra, "distill_tiny", seeded_heal=True)
    study = build_distill_study(cfg, str(tmp_path))
    assert study.get_task_family() == "DistillSeedsReport"
    ok, ran = run_graph(study)
    assert ok
    fams = [f for f, _ in ran]
    # per seed: (b) end to end at blockwise's budget and (d) at blockwise + healing's
    assert fams.count("DistillStudyReport") == 3 and fams.count("DistillE2E") == 3 * 2 and fams.count("TeacherBoundary") >= 1
    assert len([p for p in (tmp_path / "TeacherBoundary").iterdir() if "." not in p.name]) == 1
    rep = json.loads((study.out_dir / "report.json").read_text())
    assert rep["seeds"] == [0, 1, 2] and [a["name"] for a in rep["arms"]] == ["blockwise", "e2e", "healed", "e2e_healed"]
    assert all(len(a["ce"]) == 3 and len(set(a["ce"])) == 3 for a in rep["arms"])
    assert all(len(a["flops"]) == 3 and all(f > 0 for f in a["flops"]) for a in rep["arms"])
    assert [(c["a"], c["b"]) for c in rep["comparisons"]] == [("blockwise", "e2e"), ("healed", "e2e_healed"),
                                                               ("healed", "blockwise"), ("healed", "e2e"), ("e2e_healed", "e2e")]
    raw = sorted(c["p"] for c in rep["comparisons"])
    for c in rep["comparisons"]:
        assert {"a", "b", "mean_diff", "ci95", "seeds", "sequences", "verdict", "unit", "runs", "p", "p_adjusted"} <= set(c)
        assert c["unit"] == "run" and c["runs"] == 3 and c["seeds"] == [0, 1, 2] and c["sequences"] == 6
        assert c["mean_diff"] == pytest.approx(sum(c["per_seed"]) / 3)
        k = raw.index(c["p"])  # Holm: at least (m - rank) x p, never below the raw p
        assert c["p_adjusted"] >= min(1.0, (5 - k) * c["p"]) - 1e-12 and c["p_adjusted"] >= c["p"]
        assert c["verdict"] == "not resolved" and c["descriptive"]  # a random teacher: a plumbing check
    assert rep["descriptive"] and (study.out_dir / "report.md").read_text().startswith(
        "# Distillation study over seeds [0, 1, 2]: distill-tiny\n\n**plumbing check: descriptive only**")
    per_seed = [json.loads((t.out_dir / "report.json").read_text()) for t in study.requires()]
    blockwise = [next(a["ce"] for a in r["arms"] if a["name"] == "blockwise") for r in per_seed]
    assert rep["arms"][0]["ce"] == blockwise and all(len(r["comparisons"]) == 5 for r in per_seed)
    for r in per_seed:  # one seed: every method comparison has one run, never a verdict
        assert all(c["unit"] == "run" and c["runs"] == 1 and c["why"] == "fewer than 3 runs" for c in r["comparisons"])
        assert all(a["vs_untrained"]["unit"] == "sequence" for a in r["arms"])  # fixed models
        assert all(a["flops"]["total"] == a["flops"]["student"] + a["flops"]["teacher"] > 0 for a in r["arms"])
        (x,) = r["extra"]
        assert x["name"] == "stdlib-docstrings" and set(x["arms"]) == {"blockwise", "e2e", "healed", "e2e_healed"}
        assert all(v["ce"] > 0 for v in x["arms"].values())
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert sorted(p.name for p in (tmp_path / "tensorboard").iterdir()) == ["distill-tiny"]  # the study's name first
    e2e_runs = sorted((tmp_path / "tensorboard" / "distill-tiny" / "DistillE2E").iterdir())
    assert {p.name for p in (tmp_path / "tensorboard" / "distill-tiny").iterdir()} == {"DistillE2E", "Heal", "TrainBlock"}
    assert len(e2e_runs) == 6 and sum(p.name.startswith("e2e-") and "-heal" in p.name for p in e2e_runs) == 3  # arm (d)
    acc = EventAccumulator(str(e2e_runs[0]))
    acc.Reload()  # the tags docs/performance.md lists
    assert {"loss/loss", "loss/kd", "lr", "grad_norm", "throughput/tokens_per_s", "throughput/data_wait_fraction"} <= set(
        acc.Tags()["scalars"])
    fl = {a["name"]: a["flops"] for a in per_seed[0]["arms"]}
    assert fl["healed"]["student"] > fl["blockwise"]["student"] and fl["e2e_healed"]["total"] > fl["e2e"]["total"]
    two = build_distill_study(load_config("", "seeds=[0,1] eval.max_sequences=6 " + extra, "distill_tiny", seeded_heal=True),
                              str(tmp_path))
    ok, ran = run_graph(two)
    assert ok and [f for f, _ in ran] == ["DistillSeedsReport"]  # the per-seed studies are reused
    rep2 = json.loads((two.out_dir / "report.json").read_text())
    assert all(c["runs"] == 2 and c["verdict"] == "not resolved" and c["why"] == "fewer than 3 runs"
               and c["p_adjusted"] is None for c in rep2["comparisons"])
    md = (study.out_dir / "report.md").read_text()
    assert "## Comparisons" in md and all(f"- {s}" in md for s in rep["findings"])
    before = (study.out_dir / "report.json").read_bytes()
    shutil.rmtree(study.out_dir)
    ok, ran = run_graph(study)
    assert ok and [f for f, _ in ran] == ["DistillSeedsReport"] and (study.out_dir / "report.json").read_bytes() == before


def test_seeds_report_lists_each_seeds_own_lr_search():
    """A searched distillation study over seeds lists, per seed, the runs of that seed's own search (every lr
    with its score, the choice) apart from the reported runs, and says how the selection is kept out of the
    comparison (per-seed searches)."""
    from zgcore.evaluation.distill_report import seeds_markdown, seeds_report
    from zgcore.training.lr_search import summary

    rng = np.random.default_rng(0)
    reports, scores = [], []
    for seed, best in ((0, 3e-4), (1, 1e-3), (2, 3e-4)):
        res = {1e-4: 4.2, 3e-4: 4.0 if best == 3e-4 else 4.1, 1e-3: 3.95 if best == 1e-3 else 4.3}
        arms = [{"name": n, "label": n, "ce": 4.0 + 0.01 * i + 0.001 * seed, "gap_recovered": 0.5, "passes": 1000, "flops": {"total": 1e9},
                 "lrs": {"end to end": {"lr": best, "search": summary(res, 1, 3)}} if n == "e2e" else {"heal": {"lr": 1e-4}}}
                for i, n in enumerate(("blockwise", "e2e", "healed", "e2e_healed"))]
        reports.append({"arms": arms, "teacher": "t", "ce_teacher": 3.0})
        scores.append({a["name"]: a["ce"] + 0.05 * rng.standard_normal(40) for a in arms})
    rep = seeds_report("s", [0, 1, 2], reports, scores)
    assert list(rep["searches"]) == ["0", "1", "2"]
    assert all(len(v) == 1 for v in rep["searches"].values())  # one searched part per seed (arm (b)'s lr)
    assert "chosen **0.001**" in rep["searches"]["1"][0] and "chosen **0.0003**" in rep["searches"]["0"][0]
    assert "1e-04: 4.2000" in rep["searches"]["2"][0] or "0.0001: 4.2000" in rep["searches"]["2"][0]
    md = seeds_markdown(rep)
    assert "## Learning-rate searches, per seed" in md and "Per-seed searches" in md and "Seed 2:" in md
    plain = seeds_report("s", [0, 1, 2], [{**r, "arms": [{**a, "lrs": {}} for a in r["arms"]]} for r in reports], scores)
    assert plain["searches"] == {} and "Learning-rate searches" not in seeds_markdown(plain)
