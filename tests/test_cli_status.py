"""How a run ends and what `zerograph status` says: status words judged from the task's own
folder, the report's path at the end of every run (a no-op rerun too), one line and exit 130 on
Ctrl-C, one hash for every spelling of a local path, torch threads chosen per task."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import luigi
import pytest
from typer.testing import CliRunner

from tests.conftest import tiny_cfg
from workflows.cli import STATES, app, walk
from workflows.ending import INTERRUPTED, INTERRUPTED_EXIT
from workflows.experiment import build_experiment, load_config
from zgcore import threads

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
CFG = tiny_cfg()


def _status(out, cfg=CFG):
    r = CliRunner().invoke(app, ["status", "--preset", "", "--set", cfg, "--outputs", str(out)])
    rows = {" ".join(line.split()[:2]): line.split()[2] for line in r.stdout.splitlines() if line.strip()}
    return r.exit_code, rows


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("status") / "o"
    root = build_experiment(load_config(overrides=CFG, preset=""), str(out))
    assert luigi.build([root], local_scheduler=True, log_level="WARNING")
    return out


def test_status_words(built, tmp_path):
    out = tmp_path / "o"
    subprocess.run(["cp", "-a", str(built), str(out)], check=True)
    code, rows = _status(out)
    assert code == 0 and set(rows.values()) == {"done"} and len(rows) == 13

    # another learning rate: the blocks and what follows were never built for it -> missing, not stale
    code, rows = _status(out, tiny_cfg(**{"train.lr": 0.01}))
    assert code == 1
    assert rows["TrainBlock block0-clean-cached-s0"] == rows["Evaluate report"] == "missing"
    assert rows["PrepareTeacher tiny-llama"] == rows["TeacherBoundary boundaries"] == "done"

    root = build_experiment(load_config(overrides=CFG, preset=""), str(out))
    tasks = {t.title(): t for t in walk(root)}
    block0, block1 = tasks["TrainBlock block0-clean-cached-s0"], tasks["TrainBlock block1-clean-cached-s0"]
    (block0.out_dir / "block.safetensors").write_bytes(b"cut")  # cut short -> damaged
    rec = tasks["Assemble student"].out_dir / "task.json"
    rec.write_text(rec.read_text().replace('"build": "', '"build": "x'))  # Assemble rebuilt after Evaluate read it
    block1.out_dir.rename(block1.out_dir.with_name(block1.out_dir.name + ".partial"))  # interrupted, with checkpoints
    code, rows = _status(out)
    assert code == 1
    assert rows["TrainBlock block0-clean-cached-s0"] == "damaged"
    assert rows["TrainBlock block1-clean-cached-s0"] == "partial"
    assert rows["Evaluate report"] == "stale"
    assert rows["PrepareCorpus corpus-T32"] == "done"
    assert not list(out.glob("*/*.damaged-*")) and not list(out.glob("*/*.stale-*"))  # status moves nothing


def test_status_help_defines_every_word():
    r = CliRunner().invoke(app, ["status", "--help"], terminal_width=200)
    assert r.exit_code == 0
    for word in ("done", "missing", "partial", "damaged", "stale"):
        assert f"{word}: " in r.stdout and word in STATES
    guide = (ROOT / "docs" / "reliability.md").read_text()  # README links it; the words are defined there
    assert all(f"* `{word}`: " in guide for word in STATES)


def _luigi(out, *extra, cfg=CFG):
    return [sys.executable, "-m", "luigi", "--module", "workflows", "RunExperiment", "--local-scheduler",
            "--preset", "", "--outputs", str(out), "--set", cfg, *extra]


def test_every_run_ends_with_the_report_path_a_no_op_rerun_too(built, tmp_path):
    report = next(built.glob("Evaluate/report-*/report.md"))
    r = subprocess.run(_luigi(built), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ran successfully" not in r.stderr  # nothing ran
    assert r.stdout.rstrip().splitlines()[-1] == f"Report: {report}"


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path):
    out = tmp_path / "o"
    cfg = tiny_cfg(**{"train.max_steps": 1500, "train.checkpoint_every": 20})
    # its own process group, as a terminal's foreground job: Ctrl-C reaches the run and its prefetch
    # worker processes alike, and still prints one line. SIGINT's default action restored first: a
    # suite started as a background job of a non-interactive shell inherits it ignored, and so would the run
    p = subprocess.Popen(_luigi(out, cfg=cfg), cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 180
    while time.time() < deadline and not list(out.glob("TrainBlock/*.partial/checkpoint.pt")) and p.poll() is None:
        time.sleep(0.05)
    assert p.poll() is None, "the run ended before its first checkpoint"
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == INTERRUPTED_EXIT == 130, err[-3000:]
    assert err.rstrip().splitlines()[-1] == INTERRUPTED
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    r = subprocess.run(_luigi(out, cfg=cfg), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "resumed from step" in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]


def test_relative_absolute_and_symlinked_teacher_paths_give_one_folder(tmp_path, monkeypatch):
    from zgcore.models.teacher import build_tiny

    build_tiny("llama", tmp_path / "models" / "llama")
    (tmp_path / "link").symlink_to(tmp_path / "models")
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("word " * 4000)
    monkeypatch.chdir(tmp_path / "texts")
    monkeypatch.setenv("HOME", str(tmp_path))
    spellings = ["../models/llama", str(tmp_path / "models" / "llama"), "~/link/llama", "../link/./llama/"]
    sources = ["a.txt", str(tmp_path / "texts" / "a.txt"), "~/texts/a.txt", "../texts/*.txt"]
    roots = [build_experiment(load_config(overrides=tiny_cfg(teacher=t) + f" corpus.source={s} corpus.max_tokens=0",
                                          preset=""), "o") for t, s in zip(spellings, sources)]
    dirs = {t: {x.get_task_family(): x.out_dir for x in walk(r)} for t, r in zip(spellings, roots)}
    first = dirs[spellings[0]]
    assert all(d["PrepareTeacher"] == first["PrepareTeacher"] for d in dirs.values())
    assert [d["PrepareCorpus"] == first["PrepareCorpus"] for d in dirs.values()] == [True, True, True, False]  # a glob
    assert all(d["Evaluate"] == dirs[spellings[1]]["Evaluate"] for d in list(dirs.values())[:3])
    cfg = load_config(overrides=tiny_cfg(teacher="../models/llama") + " corpus.source=../texts/*.txt", preset="")
    assert cfg["teacher"] == str(tmp_path / "models" / "llama") and cfg["corpus"]["source"] == str(tmp_path / "texts/*.txt")
    assert load_config(overrides=tiny_cfg(teacher="tiny-llama"), preset="")["teacher"] == "tiny-llama"  # names stay

    # the stamp keeps a change visible: another file under the same path is another folder
    (tmp_path / "texts" / "a.txt").write_text("other " * 4000)
    luigi.task_register.Register.clear_instance_cache()  # as a new command would: Luigi caches task instances
    again = build_experiment(load_config(overrides=tiny_cfg(teacher=spellings[0]) + " corpus.source=a.txt"
                                         " corpus.max_tokens=0", preset=""), "o")
    assert {x.get_task_family(): x.out_dir for x in walk(again)}["PrepareCorpus"] != first["PrepareCorpus"]


def test_threads_follow_the_model_size_the_cores_and_the_overrides(tmp_path):
    assert threads.choose_threads(40_000, cores=8, env={}) == (1, "0.04M parameters, 8 usable core(s)")
    assert threads.choose_threads(106_000_000, cores=8, env={})[0] == 8  # SmolLM2-sized: every core
    assert threads.choose_threads(5_000_000, cores=8, env={})[0] == 3
    assert threads.choose_threads(None, cores=2, env={})[0] == 2
    assert threads.choose_threads(40_000, setting=4, cores=8, env={}) == (4, "[zerograph] threads")
    assert threads.choose_threads(40_000, setting=4, cores=8, env={"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS must be a positive integer"):
        threads.choose_threads(1, env={"OMP_NUM_THREADS": "many"})
    # the cgroup's CPU quota caps the affinity (v2: cpu.max "quota period"; v1: cfs files)
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads.cgroup_cpu_limit(tmp_path) == 1.5 and threads.usable_cores(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpu_limit(tmp_path) is None
    assert threads.usable_cores(tmp_path) == len(os.sched_getaffinity(0))
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert threads.cgroup_cpu_limit(v1) == 2.0
    assert threads.decoder_params(30, 576, 1536) == 30 * (4 * 576 * 576 + 3 * 576 * 1536)


def test_each_task_logs_its_thread_count_at_info_level(built, tmp_path):
    """The thread count is one of Luigi's INFO lines: off by default, back with ``--log-level INFO``."""
    out = tmp_path / "o"
    cfg = tiny_cfg(**{"train.lr": 0.02})  # new blocks: TrainBlock, Assemble, the student's scoring and Evaluate run
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    subprocess.run(["cp", "-a", str(built), str(out)], check=True)
    r = subprocess.run(_luigi(out, "--log-level", "INFO", cfg=cfg), cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "corpus={" not in r.stderr and "blocks=[" not in r.stderr  # no parameter JSON in Luigi's INFO lines
    assert "running   Evaluate(report-" in r.stderr  # Luigi's log lines name a task by its folder
    lines = [x for x in r.stderr.splitlines() if "torch thread(s)" in x]
    assert len(lines) == 6 and all("] 1 torch thread(s) (0.04M parameters" in x for x in lines), lines
    r = subprocess.run(_luigi(out, "--zerograph-threads", "2", "--log-level", "INFO", cfg=tiny_cfg(**{"train.lr": 0.03})),
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "] 2 torch thread(s) ([zerograph] threads)" in r.stderr, r.stderr[-3000:]
    r = subprocess.run(_luigi(out, cfg=tiny_cfg(**{"train.lr": 0.04})), cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "torch thread(s)" not in r.stdout + r.stderr, r.stderr[-3000:]
    assert "running   " not in r.stderr and "Luigi Execution Summary" not in r.stderr  # Luigi's INFO lines are off


def test_max_tokens_says_what_it_left_unread(tmp_path):
    """corpus.max_tokens stops reading: the log names the cap and how many files were never opened."""
    from zgcore.data import corpus
    from zgcore.config.defaults import DEFAULTS
    from zgcore.models.teacher import byte_tokenizer

    for i in range(5):
        (tmp_path / f"{i}.txt").write_text(f"file {i} " * 200)  # ~1,400 bytes each
    c = {**DEFAULTS["corpus"], "source": str(tmp_path / "*.txt"), "seq_len": 16, "max_tokens": 2000}
    said = []
    meta = corpus.build_token_store(tmp_path / "s.h5", c, byte_tokenizer(), "bytes", 128, log=said.append)
    assert meta["tokens"] <= 2000 and meta["source_files"] == 2
    assert said == ["corpus.max_tokens=2000 reached in the first 2 of 5 source file(s), read in name order: 3 never "
                    "opened (corpus.max_tokens=0 reads everything)"]
    said.clear()
    corpus.build_token_store(tmp_path / "all.h5", {**c, "max_tokens": 0}, byte_tokenizer(), "bytes", 128, log=said.append)
    assert said == []


def test_a_bad_thread_setting_is_one_warning_line(tmp_path):
    """OMP_NUM_THREADS=many does not fail the run: each task says so in one line and keeps torch's count."""
    r = subprocess.run(_luigi(tmp_path / "o", cfg=tiny_cfg(**{"train.max_steps": 2})), cwd=tmp_path,
                       env={**ENV, "OMP_NUM_THREADS": "many"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    warned = [x for x in r.stdout.splitlines() if "warning: OMP_NUM_THREADS must be a positive integer" in x]
    # one per task start (TeacherBoundary starts twice: it yields its shards, then joins them; four scoring tasks)
    assert len(warned) == 14 and "torch thread(s) (" not in r.stdout and "Traceback" not in r.stderr, r.stdout[-3000:]
