"""The front door: configuration errors are one line and exit 2 with no traceback, a failed run
exits non-zero from any folder, hints carry the user's options, teachers are checked up front."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import tiny_cfg
from workflows import CONFIG_ERROR_EXIT
from workflows.cli import app
from workflows.experiment import load_config
from zgcore.checks import ConfigError

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


def luigi_cmd(*args, workflow="RunExperiment"):
    return [sys.executable, "-m", "luigi", "--module", "workflows", workflow, "--local-scheduler", *args]


def run_all(cmds, cwd, env=ENV):
    """Run the commands at once (each pays torch's import): [(returncode, stdout + stderr)]."""
    procs = [subprocess.Popen(c, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    return [(p.wait(timeout=300), p.stdout.read()) for p in procs]


def test_configuration_errors_exit_2_with_one_line_and_no_traceback(tmp_path):
    out = str(tmp_path / "o")
    cases = [("train.lrr=1", "unknown key train.lrr: did you mean train.lr?"),
             ("train.lr=abc", "lr must be a number, got 'abc'"),
             ("boundary.boundaries=[0,3,2,4]", "boundary.boundaries must be strictly increasing"),
             ("boundary.boundaries=[0,2,9]", "boundary.boundaries must end at the teacher's layer count 4")]
    cmds = [luigi_cmd("--preset", "tiny", "--outputs", out, "--set", over) for over, _ in cases]
    cmds.append(luigi_cmd("--preset", "local_tiny", "--outputs", out, "--set", "study.K=[1,2,8]", workflow="LocalLearningStudy"))
    cases.append(("", "exceeds the model's 4 layers"))
    for (code, log), (_, needle) in zip(run_all(cmds, tmp_path), cases):
        assert code == CONFIG_ERROR_EXIT == 2, log[-3000:]
        assert "Traceback" not in log and needle in log
        errors = [line for line in log.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and needle in errors[0]
    assert not (tmp_path / "o").exists()  # nothing ran


def test_the_traceback_is_there_on_request(tmp_path):
    ((code, log),) = run_all([luigi_cmd("--preset", "tiny", "--set", "train.lrr=1")], tmp_path, {**ENV, "ZG_TRACEBACK": "1"})
    assert code == 2 and "Traceback" in log and "ConfigError" in log


def test_a_failed_task_exits_non_zero_outside_the_repository(tmp_path):
    corpus = tmp_path / "short.txt"
    corpus.write_text("too short")  # not two sequences of 32 tokens: PrepareCorpus fails
    assert not (tmp_path / "luigi.cfg").exists()
    ((code, log),) = run_all([luigi_cmd("--preset", "", "--outputs", "o", "--set",
                                        tiny_cfg() + f" corpus.source={corpus} corpus.max_tokens=0")], tmp_path)
    assert code == 30, log[-3000:]
    assert (tmp_path / "o" / "PrepareTeacher").is_dir()  # `outputs` is relative to the folder the command runs in


def test_zerograph_errors_and_hints_carry_the_users_options(tmp_path):
    r = CliRunner().invoke(app, ["status", "--preset", "tiny", "--set", "train.lr=abc", "--outputs", str(tmp_path)])
    assert r.exit_code == 2 and "lr must be a number" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["report", "--preset", "tiny", "--outputs", str(tmp_path / "my out")])
    assert r.exit_code == 1
    assert f".venv/bin/luigi --module workflows RunExperiment --local-scheduler --preset tiny --outputs '{tmp_path}/my out'" in r.output
    r = CliRunner().invoke(app, ["status", "--preset", "tiny", "--set", "train.lr=0.01", "--outputs", str(tmp_path)])
    assert r.exit_code == 1 and "--preset tiny --set train.lr=0.01 --outputs" in r.output.splitlines()[-1]


def _teacher_folder(path, weights=True, tokenizer=True):
    from zgcore.models.teacher import build_tiny

    build_tiny("llama", path)
    for f in path.iterdir():
        if (not weights and f.suffix == ".safetensors") or (not tokenizer and f.name.startswith("tokenizer")):
            f.unlink()
    return path


@pytest.mark.parametrize("weights, tokenizer, needle", [
    (False, True, "lacks weights (*.safetensors or pytorch_model*.bin)"),
    (True, False, "lacks a tokenizer (tokenizer.json, tokenizer.model, vocab.json)")])
def test_a_teacher_folder_without_weights_or_tokenizer_fails_before_any_task(tmp_path, weights, tokenizer, needle):
    folder = _teacher_folder(tmp_path / "teacher", weights, tokenizer)
    with pytest.raises(ConfigError, match="teacher folder .* " + needle.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        load_config(overrides=f"teacher={folder} corpus.seq_len=32", preset="")
    assert load_config(overrides=f"teacher={_teacher_folder(tmp_path / 'ok')} corpus.seq_len=32", preset="")


def test_a_teacher_path_that_does_not_exist_is_named(tmp_path):
    with pytest.raises(ConfigError, match=f"teacher path {tmp_path}/nope does not exist"):
        load_config(overrides=f"teacher={tmp_path}/nope", preset="")


def test_a_run_logs_one_line_per_task_and_ends_with_the_report(tmp_path):
    """Outside a terminal a tiny run writes a line or so per task (no progress-bar redraws, none of
    Luigi's INFO lines, no thread counts), and its last line is the report's path."""
    ((code, log),) = run_all([luigi_cmd("--preset", "tiny", "--outputs", "o")], tmp_path)
    lines = log.strip().splitlines()
    assert code == 0 and lines[-1].startswith("Report: ") and lines[-1].endswith("/report.md"), log[-3000:]
    from workflows.cli import all_tasks, root_tasks

    graph = all_tasks(root_tasks("", [], "tiny", str(tmp_path / "o"), "RunExperiment"))
    trained = sum(t.get_task_family() == "TrainBlock" for t in graph)
    # a line per task, a start line per training task, the `Report:` line (11 tasks, 2 training: 16 measured)
    assert len(lines) <= len(graph) + trained + 1 and len(log) < 250 * len(lines), log
    assert not any(s in log for s in ("INFO:", "it/s", "step/s", "torch thread(s)", "Luigi Execution Summary")), log
    assert any(x.startswith("[PrepareCorpus ") and "corpus pydoc: 4096 tokens" in x for x in lines), log


def test_progress_in_a_log_file_is_a_few_lines_with_the_bars_figures(monkeypatch):
    """LogLines: a line per tenth of the work, never two within the interval, a last one at the end."""
    import io

    from zgcore import progress

    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    bar = progress.LogLines(6000, "TrainBlock block0", "step", interval_s=30, file=out)
    for step in range(6000):
        clock[0] += 0.1  # 600 s in all: 20 intervals, 10 tenths
        bar.update(1)
        bar.set_postfix(loss=f"{1 / (step + 1):.4f}")
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 11, lines  # one per tenth after the first 30 s, and the last
    assert lines[0].startswith("TrainBlock block0:  10% 600/6000 [01:00<09:00") and "10.00step/s" in lines[0], lines[0]
    assert lines[-1].startswith("TrainBlock block0: 100% 6000/6000") and lines[-1].endswith("loss=0.0002]"), lines[-1]
    quick = progress.LogLines(20, "CE teacher", "batch", file=out)  # a few seconds' bar writes nothing
    for _ in range(20):
        quick.update(1)
    quick.close()
    assert out.getvalue().splitlines() == lines
    monkeypatch.setenv("ZG_PROGRESS", "bar")
    assert progress.on_terminal(io.StringIO()) and not isinstance(progress.progress_bar(5, "x"), progress.LogLines)
    monkeypatch.setenv("ZG_PROGRESS", "")
    assert not progress.on_terminal(io.StringIO()) and isinstance(progress.progress_bar(5, "x"), progress.LogLines)


def test_a_heterogeneous_students_tokenizer_loads_without_remote_code(tmp_path):
    """AutoTokenizer reads a library student's folder with no y/N question about its modelling code and
    no "model of type" warning; the model itself still loads, with trust_remote_code, as its own class."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from zgcore.models.adapters import build_block
    from zgcore.models.hetero import assemble_exact, save_student
    from zgcore.models.teacher import build_tiny, byte_tokenizer

    teacher = AutoModelForCausalLM.from_pretrained(build_tiny("llama", tmp_path / "teacher"), dtype=torch.float32).eval()
    channels = [list(np.arange(64, dtype=float)[::-1]) for _ in range(4)]
    blocks = [build_block(teacher, [0], "teacher", 0, intermediate_size=24, channels=channels),
              build_block(teacher, [1, 2, 3], "teacher", 0, kv_heads=1)]
    assert save_student(assemble_exact(teacher, blocks), byte_tokenizer(), tmp_path / "student")  # heterogeneous
    code = ("import sys; from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
            "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
            "print('ids', tok('hi')['input_ids'], type(model).__name__, [l.mlp.gate_proj.out_features for l in model.model.layers])")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "student")], stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, env={**ENV, "HF_MODULES_CACHE": str(tmp_path / "modules")}, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0 and "ids [104, 105] ZGHeteroLlamaForCausalLM [24, 64, 64, 64]" in r.stdout, log[-3000:]
    assert "custom code" not in log and "[y/N]" not in log and "model of type" not in log, log[-3000:]
