"""The whole graph on tiny random teachers: runs, reruns nothing, rebuilds only what a change invalidates."""
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import tiny_cfg
from workflows import RunExperiment
from workflows.cli import app, task_state, walk
from workflows.experiment import build_experiment, load_config


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_whole_graph_runs_and_student_loads_and_generates(family, tmp_path, run_graph):
    out = str(tmp_path)
    ok, ran = run_graph(RunExperiment(preset="", set=tiny_cfg(f"tiny-{family}"), outputs=out))
    assert ok
    # one train and one val shard; TeacherBoundary starts twice: it yields its shards (unknown until the corpus
    # is tokenised: Luigi's dynamic requirements), then joins them
    assert sorted(f for f, _ in ran) == sorted(["PrepareTeacher", "PrepareCorpus", "BoundaryShard", "BoundaryShard",
                                                 "TeacherBoundary", "TeacherBoundary", "TrainBlock", "TrainBlock",
                                                 "Assemble", "ScoreTeacher", "ScoreUntrained", "ScoreAssembled",
                                                 "BoundaryShift", "Evaluate", "RunExperiment"])
    ev = build_experiment(load_config(overrides=tiny_cfg(f"tiny-{family}"), preset=""), out)
    report = json.loads((ev.out_dir / "report.json").read_text())
    assert set(report["cross_entropy"]) == {"teacher", "untrained", "student"}
    assert report["layers"] == {"teacher": 4, "untrained": 2, "student": 2}
    assert all(v > 0 for v in report["cross_entropy"].values())
    # the untrained student is the block initialisation, not the trained weights
    assert report["cross_entropy"]["untrained"] != report["cross_entropy"]["student"]
    # the assembled student is a plain Hugging Face folder
    model = AutoModelForCausalLM.from_pretrained(report["model_dir"])
    tok = AutoTokenizer.from_pretrained(report["model_dir"])
    prompt = tok("The", return_tensors="pt").input_ids
    gen = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert gen.shape == (1, prompt.shape[1] + 5)
    # block losses went down; each block keeps its optimizer and RNG state
    for b in report["blocks"]:
        assert b["final_loss"] < b["first_loss"]
    import glob

    states = glob.glob(f"{out}/TrainBlock/*/train_state.pt")
    assert len(states) == 2
    for f in states:
        st = torch.load(f, weights_only=True)
        assert st["step"] == 6 and st["optimizers"][0]["state"] and st["torch_rng"].dtype == torch.uint8
    assert "assembled student" in (ev.out_dir / "report.md").read_text()


def test_incremental_rebuilds(tmp_path, run_graph):
    out = str(tmp_path)
    cfg = tiny_cfg()
    ok, ran = run_graph(RunExperiment(preset="", set=cfg, outputs=out))
    assert ok and len(ran) == 15  # TeacherBoundary starts twice (dynamic shards)
    # unchanged: nothing but the wrapper runs
    ok, ran = run_graph(RunExperiment(preset="", set=cfg, outputs=out))
    assert ok and ran == []
    # one block's learning rate: exactly that block, Assemble, the new student's scoring and the Evaluate join
    ok, ran = run_graph(RunExperiment(preset="", set=cfg + " blocks.1.lr=0.002", outputs=out))
    assert ok
    assert sorted(x for x in ran if x[0] != "RunExperiment") == sorted(
        [("TrainBlock", "block1-clean-cached-s0"), ("Assemble", "student"), ("ScoreAssembled", "student-val"),
         ("BoundaryShift", "shift"), ("Evaluate", "report")])


def test_key_order_and_int_float_in_files_do_not_rebuild(tmp_path, run_graph):
    out = str(tmp_path / "out")
    a = tmp_path / "a.toml"
    a.write_text('teacher = "tiny-llama"\n[corpus]\nseq_len = 32\nmax_tokens = 3072\n'
                 '[boundary]\nnum_blocks = 2\n[train]\nn_layers = 1\nmax_steps = 4\nlr = 0.001\nepochs = 1\n')
    b = tmp_path / "b.yaml"  # same experiment: other key order, other format, 1.0 for 1
    b.write_text("train: {epochs: 1.0, lr: 0.001, max_steps: 4.0, n_layers: 1}\nboundary: {num_blocks: 2}\n"
                 "corpus: {max_tokens: 3072, seq_len: 32}\nteacher: tiny-llama\n")
    ok, ran = run_graph(RunExperiment(preset="", config=str(a), outputs=out))
    assert ok and len(ran) == 15  # TeacherBoundary starts twice (dynamic shards)
    ok, ran = run_graph(RunExperiment(preset="", config=str(b), outputs=out))
    assert ok and [x for x in ran if x[0] != "RunExperiment"] == []


def test_status_cli_reports_done_and_missing(tmp_path, run_graph):
    from typer.testing import CliRunner

    out = str(tmp_path)
    cfg = tiny_cfg()
    r = CliRunner().invoke(app, ["status", "--preset", "", "--set", cfg, "--outputs", out])
    assert r.exit_code == 1 and " missing " in r.stdout and " done " not in r.stdout
    assert run_graph(RunExperiment(preset="", set=cfg, outputs=out))[0]
    r = CliRunner().invoke(app, ["status", "--preset", "", "--set", cfg, "--outputs", out])
    assert r.exit_code == 0 and " missing " not in r.stdout and r.stdout.count(" done ") == 13
    ev = build_experiment(load_config(overrides=cfg, preset=""), out)
    assert {task_state(t) for t in walk(ev)} == {"done"}
    changed = build_experiment(load_config(overrides=cfg + " blocks.0.lr=0.005", preset=""), out)
    states = {(t.get_task_family(), t.label()): task_state(t) for t in walk(changed)}
    # block 0 and what follows were never built for the new lr: missing, not "stale"
    assert states[("TrainBlock", "block0-clean-cached-s0")] == "missing"
    assert states[("TrainBlock", "block1-clean-cached-s0")] == "done"
    assert states[("Evaluate", "report")] == "missing"
    r = CliRunner().invoke(app, ["report", "--preset", "", "--set", cfg, "--outputs", out])
    assert r.exit_code == 0 and "held-out CE" in r.stdout
    r = CliRunner().invoke(app, ["report", "--preset", "", "--set", cfg + " train.lr=0.5", "--outputs", out])
    assert r.exit_code == 1


def _luigi(args, cwd):
    return subprocess.run([sys.executable, "-m", "luigi", "--module", "workflows", "RunExperiment", "--local-scheduler", *args],
                          cwd=cwd, capture_output=True, text=True)


def test_failed_task_exits_non_zero(tmp_path):
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    corpus = tmp_path / "short.txt"
    corpus.write_text("too short")  # 9 byte tokens: not two sequences of 32
    r = _luigi(["--preset", "", "--outputs", str(tmp_path / "o"), "--set", tiny_cfg() + f" corpus.source={corpus} corpus.max_tokens=0"], root)
    assert r.returncode == 30, r.stdout[-2000:] + r.stderr[-2000:]
    assert "add text or lower corpus.seq_len" in r.stdout + r.stderr
    assert not list((tmp_path / "o").glob("PrepareCorpus/*"))  # nothing partial left under a final name


def test_bad_config_fails_before_any_task(tmp_path):
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    r = _luigi(["--preset", "", "--outputs", str(tmp_path / "o"), "--set", tiny_cfg() + " boundary.boundaries=[0,3,2,4]"], root)
    assert r.returncode != 0
    assert "strictly increasing" in r.stderr + r.stdout
    assert not (tmp_path / "o").exists()


def test_readme_per_block_override_retrains_one_block_when_max_steps_is_set(tmp_path, run_graph):
    # README: --set "blocks.1.lr=1e-4 train.epochs=1" on the tiny preset (max_steps = 20 there, so epochs
    # takes no effect and must not move any hash): exactly block 1 retrains, then Assemble, the student's scoring
    # and Evaluate
    out = str(tmp_path)
    assert run_graph(RunExperiment(preset="tiny", outputs=out))[0]
    ok, ran = run_graph(RunExperiment(preset="tiny", set="blocks.1.lr=1e-4 train.epochs=1", outputs=out))
    assert ok
    assert sorted(x for x in ran if x[0] != "RunExperiment") == sorted(
        [("TrainBlock", "block1-clean-cached-s0"), ("Assemble", "student"), ("ScoreAssembled", "student-val"),
         ("BoundaryShift", "shift"), ("Evaluate", "report")])
