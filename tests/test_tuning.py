"""The learning-rate search in the Luigi graph: it extends past the first grid, and a diverged candidate loses without stopping the search."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zgcore import local as zl

ROOT = Path(__file__).resolve().parents[1]


def _report(out, over):
    from workflows.cli import walk
    from workflows.local import build_local_study, load_local_config

    report = build_local_study(load_local_config(overrides=over, preset="local_tiny"), str(out))
    return report, walk(report)


def _luigi(out, over, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "luigi", "--module", "workflows", "LocalLearningStudy", "--preset", "local_tiny",
           "--set", over, "--outputs", str(out), "--local-scheduler"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_search_leaves_a_grid_that_misses_the_optimum(tmp_path, run_graph):
    """19.2: the tiny preset's best lr (~1.6e-2 at its 8 steps) lies above the grid [1e-3, 4e-3]:
    the chosen lr is outside the first grid and not at an edge of what was finally searched."""
    from workflows import LocalLearningStudy

    grid = [1e-3, 4e-3]
    over = "study.K=[1] study.lrs=[1e-3,4e-3] study.lr_rounds=6"
    ok, ran = run_graph(LocalLearningStudy(preset="local_tiny", set=over, outputs=str(tmp_path)))
    assert ok
    report, tasks = _report(tmp_path, over)
    rep = json.loads((report.out_dir / "report.json").read_text())
    (row,) = rep["rows"]
    lrs, ces = row["tune_lrs"], row["tune_ce"]
    assert row["lr"] not in grid and min(lrs) < row["lr"] < max(lrs)
    assert not row["lr_search"]["at_edge"] and row["lr_search"]["converged"] and 2 < row["lr_search"]["rounds"] <= 6
    i = lrs.index(row["lr"])
    assert lrs[i] / lrs[i - 1] <= 2 and lrs[i + 1] / lrs[i] <= 2 and ces[i] == min(ces)
    # every candidate is its own task; rounds 2.. are dynamic dependencies of the choice (read like static inputs)
    (choice,) = [t for t in tasks if t.get_task_family() == "ChooseLocalLR"]
    dyn = choice.dynamic_upstream()
    assert sorted(float(t.setup["train"]["lr"]) for t in choice.requires() + dyn) == lrs and len(dyn) == len(lrs) - 2
    assert [f for f, _ in ran].count("PretrainLocal") == len(lrs)  # at the full budget: the chosen run is the final run
    md = (report.out_dir / "report.md").read_text()
    assert f"**{row['lr']:g}: " in md and "interior, neighbours within 2x" in md
    # rerun: nothing to do
    ok, ran = run_graph(LocalLearningStudy(preset="local_tiny", set=over, outputs=str(tmp_path)))
    assert ok and [f for f, _ in ran if f != "LocalLearningStudy"] == []


def test_a_diverging_lr_loses_and_the_study_goes_on(tmp_path):
    """20.5: the tiny preset with study.lrs=[1e-3, 1e9] exits 0, picks 1e-3 and lists 1e9 as
    diverged (study.lr_rounds=1: the grid alone, so 1e-3 is the only finite candidate)."""
    over = "study.lrs=[1e-3,1e9] study.lr_rounds=1"
    proc = _luigi(tmp_path, over)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report, tasks = _report(tmp_path, over)
    rep = json.loads((report.out_dir / "report.json").read_text())
    assert len(rep["rows"]) == 9  # K=1; K=2 and K=4 x {mlp, transformer} x MTP {off, first}
    for row in rep["rows"]:
        assert row["lr"] == 1e-3 and row["tune_lrs"] == [1e-3, 1e9] and row["tune_ce"][1] is None
        (d,) = row["lr_search"]["diverged"]
        assert d["lr"] == 1e9 and d["step"] >= 1 and ("gradient norm" in d["what"] or "loss" in d["what"])
    md = (report.out_dir / "report.md").read_text()
    assert "1e+09: diverged" in md and "| 1e+09 (" in md
    # the diverged candidate's whole output is a small record
    pre = [t for t in tasks if t.get_task_family() == "PretrainLocal" and float(t.setup["train"]["lr"]) == 1e9]
    assert pre and all(sorted(p.name for p in t.out_dir.iterdir()) == ["diverged.json", "task.json", "task.json.sha256"] for t in pre)


def test_the_issues_command_with_the_default_search_also_survives_divergence(tmp_path):
    """The issue's exact command (default study.lr_rounds = 4): exit 0, 1e9 listed as diverged in
    every configuration, and each chosen lr is the lowest tuning CE of what the search tried (on the
    tiny preset's 8 steps that is above 1e-3: the search leaves the grid, as it should)."""
    over = "study.lrs=[1e-3,1e9]"
    proc = _luigi(tmp_path, over)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report, _ = _report(tmp_path, over)
    rep = json.loads((report.out_dir / "report.json").read_text())
    for row in rep["rows"]:
        assert [d["lr"] for d in row["lr_search"]["diverged"]] == [1e9] and row["tune_ce"][-1] is None
        finite = [(ce, lr) for lr, ce in zip(row["tune_lrs"], row["tune_ce"]) if ce is not None]
        assert row["lr"] == min(finite)[1] and 1e-3 in row["tune_lrs"] and row["lr_search"]["rounds"] == 4


def test_a_study_fails_when_every_candidate_diverges(tmp_path):
    proc = _luigi(tmp_path, "study.K=[1] study.lrs=[1e8,1e9] study.lr_rounds=1")
    assert proc.returncode != 0
    assert "every learning rate of [100000000.0, 1000000000.0] diverged" in proc.stdout + proc.stderr


def test_distill_study_searches_the_end_to_end_arms_lr_and_survives_divergence(tmp_path, run_graph):
    """19.3 / 20.5 in the distillation study: distill.lrs searches both end-to-end arms (b) and (d)
    at their own full budgets; a diverging lr loses and is listed; the report states each arm's lr."""
    from workflows import load_config
    from workflows.distill import build_distill_study

    cfg = load_config("", "distill.lrs=[1e-3,1e9] distill.lr_rounds=2 eval.max_sequences=5", "distill_tiny")
    study = build_distill_study(cfg, str(tmp_path))
    ok, ran = run_graph(study)
    assert ok
    rep = json.loads((study.out_dir / "report.json").read_text())
    arms = {a["name"]: a for a in rep["arms"]}
    # candidates are scored on the validation sequences outside the test subset, the arms on the test subset
    n_val = _n_val(tmp_path)
    cands = [p for p in tmp_path.glob("EvaluateStudent/*/eval.json") if json.loads(p.read_text()).get("ce") is not None]
    tuned = [json.loads(p.read_text()) for p in cands]
    assert {e["val_tokens"] for e in tuned} == {(n_val - 5) * 32, 5 * 32} and n_val > 5
    assert len({e["subset_sha256"] for e in tuned}) == 2
    for name in ("e2e", "e2e_healed"):
        s = arms[name]["lrs"]["e2e"]["search"]
        assert s["grid"] == [1e-3, 1e9] and s["rounds"] == 2 and arms[name]["lrs"]["e2e"]["lr"] == s["best_lr"]
        # round 2: one step below the best (1e-3 at the low edge) and 4x towards the far, diverged 1e9
        assert s["lrs"] == [2.5e-4, 1e-3, 4e-3, 1e9] and s["scores"][-1] is None
        assert [d["lr"] for d in s["diverged"]] == [1e9] and s["diverged"][0]["step"] >= 1
        finite = [(sc, lr) for lr, sc in zip(s["lrs"], s["scores"]) if sc is not None]
        assert s["best_lr"] == min(finite)[1]
    # the arm's model is its chosen candidate's, bit for bit
    model = study.requires()["e2e_model"]
    best = model.candidate_task(arms["e2e"]["lrs"]["e2e"]["lr"])
    assert (model.out_dir / "model" / "model.safetensors").read_bytes() == (best.out_dir / "model" / "model.safetensors").read_bytes()
    md = (study.out_dir / "report.md").read_text()
    assert "Learning-rate searches" in md and "diverged: 1e+09" in md and "(searched, " in md
    # blocks were not searched: their configured lr is stated
    assert arms["blockwise"]["lrs"] == {"block 0": {"lr": 1e-3}, "block 1": {"lr": 1e-3}}


def _n_val(out) -> int:
    from zgcore.data.corpus import read_meta

    return int(read_meta(next(Path(out).glob("PrepareCorpus/*/tokens.h5")))["n_val"])


def test_a_search_with_the_whole_validation_split_as_test_fails_before_any_work(tmp_path):
    from workflows import load_config
    from zgcore.checks import ConfigError

    for key in ("train.lrs", "blocks.1.lrs", "distill.lrs"):
        with pytest.raises(ConfigError, match=f"{key} scores its candidates on validation sequences outside the test "
                                              "subset, but eval.max_sequences = 0"):
            load_config("", f"{key}=[1e-3,3e-3]", "distill_tiny")


def test_blockwise_arm_searches_each_blocks_lr_on_its_validation_loss(tmp_path, run_graph):
    """19.3: train.lrs searches every block's lr (each candidate its own TrainBlock, scored by its
    validation loss); a diverging lr loses; the assembled student is built from the chosen blocks."""
    from safetensors.torch import load_file

    from workflows import load_config
    from workflows.distill import build_distill_study

    cfg = load_config("", "train.lrs=[1e-3,1e9] train.lr_rounds=2 eval.max_sequences=5", "distill_tiny")
    study = build_distill_study(cfg, str(tmp_path))
    ok, ran = run_graph(study)
    assert ok
    arms = {a["name"]: a for a in json.loads((study.out_dir / "report.json").read_text())["arms"]}
    blocks = study.requires()["blocks"]
    for i, task in enumerate(blocks):
        got = arms["blockwise"]["lrs"][f"block {i}"]
        s = got["search"]
        assert s["grid"] == [1e-3, 1e9] and s["lrs"] == [2.5e-4, 1e-3, 4e-3, 1e9] and s["rounds"] == 2
        assert s["scores"][-1] is None and [d["lr"] for d in s["diverged"]] == [1e9] and got["lr"] == s["best_lr"]
        # each score is the candidate's own validation loss, and the block's weights are the chosen candidate's
        best = task.candidate_task(s["best_lr"])
        assert load_file(str(task.out_dir / "block.safetensors")).keys() == load_file(str(best.out_dir / "block.safetensors")).keys()
        assert (task.out_dir / "block.safetensors").read_bytes() == (best.out_dir / "block.safetensors").read_bytes()
        finite = [(v, lr) for lr, v in zip(s["lrs"], s["scores"]) if v is not None]
        assert min(finite)[1] == s["best_lr"] and all(v > 0 for v, _ in finite)
    # each candidate is scored on the validation sequences outside the test subset of 5
    scored = [json.loads(p.read_text()) for p in tmp_path.glob("ScoreBlock/*/score.json")]
    assert scored and {e["sequences"] for e in scored if e["val_loss"] is not None} == {_n_val(tmp_path) - 5}
    assert arms["healed"]["lrs"]["block 0"] == arms["blockwise"]["lrs"]["block 0"]
    # the experiment's own report carries each block's chosen lr and its search
    ev = json.loads((study.requires()["blockwise"].out_dir / "report.json").read_text())
    assert [b["lr"] for b in ev["blocks"]] == [arms["blockwise"]["lrs"][f"block {i}"]["lr"] for i in range(2)]
    assert all(b["lr_search"]["diverged"][0]["lr"] == 1e9 for b in ev["blocks"])
    md = (study.out_dir / "report.md").read_text()
    assert "(a) ZeroGraph blockwise, block 0: chosen" in md
    # without train.lrs a block's hash is what it was: lrs and lr_rounds are not hashed then
    from zgcore.config.experiment import effective_train

    plain = load_config("", "", "distill_tiny")["train"]
    assert "lrs" not in effective_train(plain) and "lr_rounds" not in effective_train(plain)
    assert "lr" not in effective_train({**plain, "lrs": [1e-3]})


@pytest.mark.parametrize("preset, least", [("local_cpu_10tpp", 10), ("local_gpu_125m", 20), ("local_gpu_400m", 20)])
def test_presets_reach_their_tokens_per_parameter_with_the_search_at_the_full_budget(preset, least):
    """19.6: the CPU preset trains >= 10 tokens per non-embedding parameter, the GPU presets the
    paper's 20, counted by the report's own code (zgcore.local.tokens_per_parameter), and each
    searches every configuration's lr at the full budget."""
    from workflows.local import load_local_config

    cfg = load_local_config(preset=preset)
    tpp = zl.planned_tokens_per_parameter(cfg)
    assert least <= tpp["ratio"] < least * 1.01
    assert len(cfg["study"]["lrs"]) >= 3 and cfg["study"]["lr_rounds"] >= 3 and cfg["study"]["tune_fraction"] == 1.0
    cells = zl.expand_study(cfg)
    assert [(c["K"], c["aux"], c["mtp"]) for c in cells] == [
        (1, "none", "off"), (2, "mlp", "off"), (4, "mlp", "off"), (4, "transformer", "off"),
        (4, "transformer", "first"), (4, "transformer", "all")]
    if preset == "local_cpu_10tpp":  # the meta-device count is the real model's count, as the report takes it
        run = cells[0]["run"]
        lm = zl.build_local(run, 1025, 128)
        real = zl.tokens_per_parameter(sum(p.numel() for p in lm.model.parameters()), 1025, 32, tpp["tokens"])
        assert real == tpp and tpp["non_embedding_parameters"] == 98848


def test_the_distill_preset_searches_every_arm_on_tuning_sequences_apart_from_its_test_sequences():
    """19.8: the SmolLM2 distillation preset runs >= 2 seeds with every block's lr and both
    end-to-end arms' lrs searched, and leaves validation sequences outside the test subset to tune on."""
    from workflows import load_config
    from workflows.distill import build_distill_study

    cfg = load_config("", "", "distill", seeded_heal=True)
    assert len(cfg["seeds"]) >= 2 and len(cfg["train"]["lrs"]) >= 3 and len(cfg["distill"]["lrs"]) >= 3
    assert cfg["train"]["lr_rounds"] >= 2 and cfg["distill"]["lr_rounds"] >= 2 and cfg["heal"]["steps"] > 0
    # 20% of the default corpus's ~440 sequences held out: 44 test sequences and as many to tune on
    assert cfg["corpus"]["val_fraction"] == 0.2 and cfg["eval"]["max_sequences"] == 44
    study = build_distill_study(cfg, "/nonexistent-outputs")
    blocks = [t for report in study.requires() for t in report.requires()["blocks"]]  # one study per seed
    assert len(blocks) == 3 * len(cfg["seeds"])
    assert all(t.train["tune"] == {"max_sequences": 44, "subset_seed": 0} and t.train["lrs"] for t in blocks)
