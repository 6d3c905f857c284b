"""`zerograph`'s commands as a new user meets them: verify's progress off a terminal, report on a
stale upstream, clean with the workflows' options."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k not in ("ZG_PROGRESS", "TQDM_DISABLE")}
ENV.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
VERIFY = """
from workflows.verify import verify
from workflows.verify_outputs import Item

def check(progress):
    for _ in range(64):
        progress(1 << 20)
    return []

items, problems = verify([], checkers=[lambda tasks: [Item("64 MB", 64 << 20, check)]])
print(len(items), problems)
"""


def _verify_stderr(tmp_path: Path, **env: str) -> str:
    err = tmp_path / "err.txt"
    with open(err, "w") as f:  # a file, not a terminal, as in `zerograph verify 2> file`
        r = subprocess.run([sys.executable, "-c", VERIFY], cwd=ROOT, env={**ENV, **env}, stdout=subprocess.PIPE,
                           stderr=f, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "1 []", (r.stdout, err.read_text())
    return err.read_text()


def test_verify_draws_no_bar_into_a_file(tmp_path):
    assert _verify_stderr(tmp_path) == ""
    drawn = _verify_stderr(tmp_path, ZG_PROGRESS="bar")  # what a terminal gets: the check can tell them apart
    assert "verify: 100%" in drawn and "67.1M/67.1M" in drawn, drawn


def test_report_on_a_stale_upstream_exits_1_as_status_does(tmp_path):
    import luigi
    from typer.testing import CliRunner

    from tests.conftest import tiny_cfg
    from workflows.cli import app, walk
    from workflows.experiment import build_experiment, load_config

    out, cfg = tmp_path / "o", tiny_cfg()
    root = build_experiment(load_config(overrides=cfg, preset=""), str(out))
    assert luigi.build([root], local_scheduler=True, log_level="WARNING")
    args = ["--preset", "", "--set", cfg, "--outputs", str(out)]
    r = CliRunner().invoke(app, ["report", *args])
    assert r.exit_code == 0 and "# " in r.stdout and "out of date" not in r.stderr, r.stderr

    rec = {t.title(): t for t in walk(root)}["Assemble student"].out_dir / "task.json"
    rec.write_text(rec.read_text().replace('"build": "', '"build": "x'))  # Assemble rebuilt after Evaluate read it
    status = CliRunner().invoke(app, ["status", *args])
    r = CliRunner().invoke(app, ["report", *args])
    assert status.exit_code == 1 and "Evaluate report" in status.stdout and " stale " in status.stdout
    assert r.exit_code == 1 and "# " in r.stdout, r.stderr  # the report still printed, then why it is behind
    assert r.stderr.startswith("this report is out of date (") and "Evaluate report is stale" in r.stderr, r.stderr
    assert "; rebuild with: .venv/bin/luigi --module workflows RunExperiment" in r.stderr, r.stderr


def test_a_block_that_keeps_its_whole_partition_of_the_teacher_warns_in_one_line():
    code = ("import sys\nfrom workflows.experiment import load_config\n"
            "load_config(overrides='teacher=tiny-llama corpus.seq_len=32 boundary.num_blocks=3 ' + sys.argv[1], "
            "preset='')\n")
    copies = subprocess.run([sys.executable, "-c", code, ""], cwd=ROOT, env=ENV, capture_output=True, text=True,
                            timeout=120)
    warned = [ln for ln in copies.stderr.splitlines() if ln.startswith("warning: ")]
    assert copies.returncode == 0 and len(warned) == 1, copies.stderr[-2000:]  # 4 layers in 3 blocks: all kept
    assert warned[0].startswith("warning: block(s) 0, 1, 2 keep every layer of their partition of the teacher's 4")
    for fine in ("train.n_layers=1 boundary.num_blocks=2", "train.init=random", "train.mixer=window train.window=8"):
        r = subprocess.run([sys.executable, "-c", code, fine], cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and "warning: " not in r.stderr, (fine, r.stderr[-2000:])
