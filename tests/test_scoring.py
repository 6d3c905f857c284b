"""Scoring as tasks keyed by what they read: a one-block change scores only the new student, the
teacher is scored once per corpus across experiments, the join reproduces the old figures, and
every scoring task records its FLOPs and MFU."""
import json

import numpy as np
import pytest

from tests.conftest import tiny_cfg
from workflows import RunExperiment
from workflows.experiment import build_experiment, load_config
from zgcore.evaluation import metrics


@pytest.fixture
def count_ce(monkeypatch):
    """Every held-out CE pass run in this process, by the model it scored (``CE <key> on <set>``)."""
    seen = []
    real = metrics.sequence_cross_entropy

    def counting(model, tokens, batch_size=8, desc="eval"):
        seen.append(desc)
        return real(model, tokens, batch_size, desc)

    monkeypatch.setattr(metrics, "sequence_cross_entropy", counting)
    return seen


def test_a_one_block_change_scores_only_the_new_student(tmp_path, run_graph, count_ce):
    out, cfg = str(tmp_path), tiny_cfg()
    assert run_graph(RunExperiment(preset="", set=cfg, outputs=out))[0]
    assert sorted(count_ce) == ["CE student on val", "CE teacher on val", "CE untrained on val"]
    count_ce.clear()
    ok, ran = run_graph(RunExperiment(preset="", set=cfg + " blocks.1.lr=0.002", outputs=out))
    assert ok
    assert sorted(x for x in ran if x[0] != "RunExperiment") == sorted(
        [("TrainBlock", "block1-clean-cached-s0"), ("Assemble", "student"), ("ScoreAssembled", "student-val"),
         ("BoundaryShift", "shift"), ("Evaluate", "report")])
    assert count_ce == ["CE student on val"]  # neither the teacher nor the untrained student is scored again


def test_two_experiments_differing_in_a_block_setting_score_the_teacher_once(tmp_path, run_graph, count_ce):
    out = str(tmp_path)
    a = build_experiment(load_config(overrides=tiny_cfg(), preset=""), out)
    b = build_experiment(load_config(overrides=tiny_cfg(**{"blocks.0.lr": 0.003}), preset=""), out)
    ok, ran = run_graph(a, b)
    assert ok
    fams = [f for f, _ in ran]
    assert fams.count("ScoreTeacher") == 1 and fams.count("ScoreUntrained") == 1 and fams.count("Evaluate") == 2
    assert fams.count("ScoreAssembled") == 2
    assert count_ce.count("CE teacher on val") == 1
    ra, rb = (json.loads((e.out_dir / "report.json").read_text()) for e in (a, b))
    assert ra["cross_entropy"]["teacher"] == rb["cross_entropy"]["teacher"]
    assert ra["cross_entropy"]["student"] != rb["cross_entropy"]["student"]


@pytest.mark.parametrize("over", [{}, {"train.init": "random"},
                                  {"train.keep": "importance", "train.intermediate_size": 32, "train.importance_sequences": 4}])
def test_the_join_reports_what_the_models_score_when_run_directly(over, tmp_path, run_graph):
    """The scores the report joins are, bit for bit, those of the teacher and of the untrained
    student rebuilt from the blocks' own saved initial weights (what Evaluate computed itself
    before), for teacher-initialised, random and measured (kept by influence, narrowed) blocks."""
    from zgcore.evaluation.compare import SCORES, load_scores
    from zgcore.models.adapters import assemble
    from tasks.blocks import load_blocks
    from zgcore.data import corpus

    out = str(tmp_path)
    ev = build_experiment(load_config(overrides=tiny_cfg(**{"eval.max_sequences": 6, **over}), preset=""), out)
    assert run_graph(ev)[0]
    _rec, (teacher, _tok) = ev.load_teacher()
    val = corpus.read_tokens(ev.requires()["corpus"].out_dir / "tokens.h5", "val")
    rows = metrics.eval_subset(len(val), 6, 0)
    untrained = assemble(teacher, load_blocks(teacher, ev.block_tasks(), "init"))
    got = load_scores(ev.out_dir / SCORES)["val"]
    assert got["rows"] == rows.tolist()
    for key, model in (("teacher", teacher), ("untrained", untrained)):
        want = metrics.sequence_cross_entropy(model, val[rows], 8)
        assert np.array_equal(got["ce"][key], want), key
    report = json.loads((ev.out_dir / "report.json").read_text())
    assert report["cross_entropy"]["untrained"] == float(metrics.sequence_cross_entropy(untrained, val[rows], 8).mean())
    cu = metrics.context_use(teacher, val[rows][:2], 8)
    assert report["context_use"]["teacher"] == cu


def test_every_phase_has_its_flops_and_mfu(tmp_path, run_graph):
    out = str(tmp_path)
    ev = build_experiment(load_config(overrides=tiny_cfg(), preset=""), out)
    assert run_graph(ev)[0]
    report = json.loads((ev.out_dir / "report.json").read_text())
    phases = [r["phase"] for r in report["mfu"]]
    assert phases[:3] == ["cache build", "block 0", "block 1"]
    assert {"scoring teacher-val", "scoring untrained-val", "scoring student-val", "scoring boundary shift"} <= set(phases)
    for r in report["mfu"]:
        assert r["flops"] > 0 and r["seconds"] > 0 and 0 < r["mfu"] < 10 and r["peak_gflops_per_second"] > 0, r
    scored = json.loads(next(tmp_path.glob("ScoreTeacher/*/metrics.json")).read_text())
    assert scored["flops"] > 0 and scored["peak"]["dtype"] == "float32" and scored["mfu"] > 0
    assert "## Compute utilisation" in (ev.out_dir / "report.md").read_text()


def test_mfu_probe_is_measured_once_per_process_and_divides():
    from zgcore.training import mfu

    p = mfu.probe("cpu")
    assert p["peak_flops_per_second"] > 1e6 and p["dtype"] == "float32" and mfu.probe("cpu") is p
    u = mfu.utilisation(int(p["peak_flops_per_second"]), 2.0, "cpu")
    assert u["mfu"] == pytest.approx(0.5) and u["flops_per_second"] == pytest.approx(p["peak_flops_per_second"] / 2)
    assert mfu.utilisation(10, 0.0)["mfu"] is None


def test_scoring_flops_count_the_ce_and_context_passes():
    from zgcore.evaluation import flops

    par = {"layers": [100, 100], "head": 50, "width": 4}
    one = flops.layers_forward([100, 100], 8, 4) + 100  # per token: layers and the head (2 x 50)
    assert flops.forward_flops(par, 16, 8) == 16 * one
    assert flops.scoring_flops(par, 2, 8) == 16 * one
    win = flops.layers_forward([100, 100], 2, 4) + 100
    assert flops.scoring_flops(par, 2, 8, 1, 2) == 16 * one + 8 * one + 4 * 2 * win


def block_bound_problems(before, after) -> list[str]:
    """Tasks of graph ``after`` (a block setting changed) whose hash moved although nothing they
    read depends on a trained block (no TrainBlock upstream of them): each would run again for nothing."""
    from luigi.task import flatten

    def reads_blocks(t, seen=None) -> bool:
        return any(u.get_task_family() == "TrainBlock" or reads_blocks(u) for u in flatten(t.requires()))

    old = {(t.get_task_family(), t.label()): t.uid for t in before}
    return [f"{t.title()} moved its hash" for t in after if t.get_task_family() != "TrainBlock"
            and not reads_blocks(t) and (t.get_task_family(), t.label()) in old
            and old[(t.get_task_family(), t.label())] != t.uid]


def test_no_task_that_reads_no_trained_block_moves_when_a_block_setting_changes(tmp_path):
    """Over every task of the experiment graph (scoring tasks included): a block's lr, steps or
    objective move only the tasks downstream of a TrainBlock."""
    from tasks.score import ScoreTeacher
    from workflows.cli import walk

    out = str(tmp_path)
    graph = lambda over: walk(build_experiment(load_config(overrides=tiny_cfg(**over), preset=""), out))  # noqa: E731
    base = graph({})
    for over in ({"blocks.1.lr": 0.003}, {"train.max_steps": 4}, {"train.objective": "noisy"}):
        assert not block_bound_problems(base, graph(over)), over

    class HashesBlocks(ScoreTeacher):  # a scoring task that hashes the blocks' settings it never reads
        blocks = __import__("luigi").ListParameter(default=[])

        def model_config(self):
            return {"blocks": list(self.blocks)}

    st = next(t for t in base if t.get_task_family() == "ScoreTeacher")
    kw = dict(teacher=st.teacher, corpus=st.corpus, eval=st.eval, outputs=out)
    assert block_bound_problems([HashesBlocks(blocks=[{"lr": 1}], **kw)], [HashesBlocks(blocks=[{"lr": 2}], **kw)]) == [
        "HashesBlocks teacher-val moved its hash"]
