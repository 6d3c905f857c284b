"""Seeds and the six-arm objective study on a tiny model."""
import json

import pytest

from tests.conftest import tiny_cfg
from workflows import ObjectiveStudy, RunExperiment
from workflows.experiment import build_experiment, build_study, load_config


def caches(out):
    """The teacher caches built under ``out`` (finished folders only)."""
    return [p for p in (out / "TeacherBoundary").iterdir() if "." not in p.name]


def test_seeds_share_the_cache_and_summarise(tmp_path, run_graph):
    cfg = tiny_cfg(**{"seeds": "[3,4]"})
    ok, ran = run_graph(RunExperiment(preset="", set=cfg, outputs=str(tmp_path)))
    assert ok
    fams = [f for f, _ in ran]
    # one cache for both seeds (TeacherBoundary may start twice: it yields its shards when the corpus is new)
    assert len(caches(tmp_path)) == 1 and fams.count("TrainBlock") == 4 and fams.count("Evaluate") == 2
    root = build_experiment(load_config(overrides=cfg, preset=""), str(tmp_path))
    summary = json.loads((root.out_dir / "report.json").read_text())
    assert [r["seed"] for r in summary["rows"]] == [3, 4]
    ces = [r["ce_student"] for r in summary["rows"]]
    assert ces[0] != ces[1]  # different seeds, different students
    assert summary["aggregate"]["ce_student"]["mean"] == pytest.approx(sum(ces) / 2)
    assert "± " in (root.out_dir / "report.md").read_text()
    # complete means whole: a SeedSummary missing a file is rebuilt, nothing upstream of it
    (root.out_dir / "report.md").unlink()
    ok, ran = run_graph(RunExperiment(preset="", set=cfg, outputs=str(tmp_path)))
    assert ok and [f for f, _ in ran if f != "RunExperiment"] == ["SeedSummary"]
    assert "plumbing checks" in (root.out_dir / "report.md").read_text()  # tiny-llama is a random teacher


def test_objective_study_six_arms(tmp_path, run_graph):
    cfg = tiny_cfg(**{"train.max_steps": 8})
    ok, ran = run_graph(ObjectiveStudy(preset="", set=cfg, outputs=str(tmp_path)))
    assert ok
    fams = [f for f, _ in ran]
    assert len(caches(tmp_path)) == 1 and fams.count("Evaluate") == 6 and fams.count("TrainBlock") == 12
    root = build_study(load_config(overrides=cfg, preset=""), str(tmp_path))
    rep = json.loads((root.out_dir / "report.json").read_text())
    assert [r["arm"] for r in rep["rows"]] == ["clean/cached", "clean/online", "noisy/cached", "noisy/online",
                                               "denoise/cached", "denoise/online"]
    assert rep["identical"] == {"clean/s0": True, "noisy/s0": True, "denoise/s0": True}
    comps = {(c["a"], c["b"]): c for c in rep["comparisons"]}
    assert ("noisy/cached", "clean/cached") in comps and ("denoise/online", "noisy/online") in comps
    for c in comps.values():
        assert {"a", "b", "mean_diff", "ci95", "seeds", "sequences", "verdict"} <= set(c) and c["seeds"] == [0]
    for obj in ("clean", "noisy", "denoise"):  # cached and online arms are the same run: identical CE, no verdict
        same = comps[(f"{obj}/online", f"{obj}/cached")]
        assert same["verdict"] == "not resolved" and same["mean_diff"] == 0 and same["ci95"] == [0.0, 0.0]
    assert "## Comparisons" in (root.out_dir / "report.md").read_text()
    assert (root.out_dir / "arms.png").stat().st_size > 1000
    den = next(r for r in rep["rows"] if r["arm"] == "denoise/cached")
    assert all(x > 0 for x in den["local_reduction"])  # denoising error went down in every block
    # complete means whole: one block file cut short rebuilds that block and what reads it, the study report too
    blk = next(tmp_path.glob("TrainBlock/block1-denoise-online-*/block.safetensors"))
    blk.write_bytes(blk.read_bytes()[:-4])
    ok, ran = run_graph(ObjectiveStudy(preset="", set=cfg, outputs=str(tmp_path)))
    assert ok and sorted(f for f, _ in ran if f != "ObjectiveStudy") == ["Assemble", "BoundaryShift", "Evaluate",
                                                                       "ObjectiveStudyReport", "ScoreAssembled",
                                                                       "TrainBlock"]
    assert json.loads((root.out_dir / "report.json").read_text())["identical"]["denoise/s0"] is True


def _arm(objective, **block):
    b = {"final_loss": 0.1, "first_loss": 0.2, "objective": objective, "seconds": 1.0, **block}
    rep = {"blocks": [b, b], "cross_entropy": {"student": 3.0, "teacher": 2.9, "untrained": 5.0},
           "gap_recovered": 0.95, "gates": {}}
    return {"objective": objective, "targets": "cached", "seed": 0, "report": rep, "block_files": []}


def test_a_conversion_studys_report_is_titled_so_and_names_its_mixer_and_window():
    from zgcore.evaluation.study import objective_study, study_markdown

    conv = objective_study([_arm(o, mixer="linear_window", window=8) for o in ("clean", "attention_transfer")])
    md = study_markdown(conv)
    assert md.startswith("# ZeroGraph conversion study: mixer linear_window, window 8 tokens\n"), md[:200]
    assert "objective study" not in md.splitlines()[0]
    plain = study_markdown(objective_study([_arm(o) for o in ("clean", "noisy")]))
    assert plain.startswith("# ZeroGraph objective study\n") and "conversion" not in plain.splitlines()[0]
