"""`zerograph` starts without torch or transformers (a subcommand imports what it needs when it
runs), and `zerograph clean` lists and, with --yes, removes what runs set aside under the outputs."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from workflows.cli import app
from zgcore.atomic import this_host

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
HELP = ("import sys\nfrom workflows.cli import main\nsys.argv = ['zerograph', 'status', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('HEAVY', sorted(m for m in ('torch', 'transformers', 'h5py', 'tasks') if m in sys.modules))")
MAX_RATIO = 40  # `zerograph status --help` against `python -c pass`: ~10-15 without torch, 60+ with it


def _best_of(cmd: list[str], n: int = 3) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, check=True, timeout=120)
        best = min(best, time.perf_counter() - t0)
    return best


def test_status_help_imports_neither_torch_nor_transformers():
    r = subprocess.run([sys.executable, "-c", HELP], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout and "Usage:" in r.stdout, r.stdout[-500:]


def test_status_help_starts_within_a_bound_of_a_bare_interpreter():
    bare = _best_of([sys.executable, "-c", "pass"])
    cli = _best_of([sys.executable, "-c", HELP])
    assert cli / bare < MAX_RATIO, f"`zerograph status --help` took {cli:.2f} s, {cli / bare:.0f}x `python -c pass`"


STATUS = ("import sys\nfrom workflows.cli import main\nsys.argv = ['zerograph', *sys.argv[1:]]\n"
          "try:\n    main()\nexcept SystemExit:\n    pass\n"
          "print('HEAVY', sorted(m for m in ('transformers', 'zgcore.models.hf_converted_llama') if m in sys.modules))")


def test_status_and_report_of_a_tiny_preset_import_no_transformers(tmp_path):
    # transformers (and the converted student's modelling file) load where a model runs; bench/cli_startup.py
    # prints the seconds
    for cmd in ("status", "report"):
        r = subprocess.run([sys.executable, "-c", STATUS, cmd, "--preset", "tiny", "--outputs", str(tmp_path)],
                           cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert "HEAVY []" in r.stdout, (cmd, r.stdout[-500:], r.stderr[-2000:])
        assert ("missing" in r.stdout) if cmd == "status" else ("no report yet" in r.stderr), (cmd, r.stdout[-500:])


def test_a_tiny_teachers_description_is_its_configs():
    from zgcore.models.channels import mlp_width
    from zgcore.models.teacher import TINY_FAMILIES, TeacherInfo, describe, tiny_config

    for spec, family in TINY_FAMILIES.items():
        c = tiny_config(family)
        n_layers = getattr(c, "num_hidden_layers", None) or c.n_layer
        max_pos = getattr(c, "max_position_embeddings", None) or c.n_positions
        assert describe(spec) == TeacherInfo(spec, c.model_type, n_layers, c.hidden_size, max_pos, mlp_width(c)), spec


def test_the_mixer_names_are_the_exported_files_own():
    from zgcore.models import hf_converted_llama as exported
    from zgcore.models import mixers

    for name in ("MIXERS", "WINDOWED", "FEATURED"):
        assert getattr(mixers, name) == getattr(exported, name), name


def _tree(out: Path) -> dict[str, Path]:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs: its temporary names are a dead writer's
    t = {
        "done": out / "TrainBlock" / "block0-abc",
        "partial": out / "TrainBlock" / "block0-abc.partial",
        "stale": out / "TrainBlock" / "block0-abc.stale-20261203-190405-a1b2c3",
        "damaged": out / "Evaluate" / "report-def.damaged-20261203-190406-d4e5f6",
        "stats": out / "TeacherBoundary" / "join" / "stats-b1.npy.damaged-1764788000",
        "dead_tmp": out / "Assemble" / f".student-1.tmp-{this_host()}-{dead.pid}-deadbeef",
        "live_tmp": out / "Assemble" / f".student-2.tmp-{this_host()}-{os.getpid()}-cafef00d",
    }
    for name, p in t.items():
        if name in ("stats",):
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"x" * 1000)
        else:
            p.mkdir(parents=True)
            (p / "f.bin").write_bytes(b"x" * 2_000_000)
    return t


def test_clean_lists_set_aside_folders_with_sizes_and_removes_them_with_yes(tmp_path):
    out = tmp_path / "o"
    t = _tree(out)
    r = CliRunner().invoke(app, ["clean", "--outputs", str(out)], terminal_width=400)
    assert r.exit_code == 0, r.output
    listed = [ln for ln in r.stdout.splitlines() if " MB " in ln]
    assert len(listed) == 4, r.stdout
    for name, kind in (("stale", "stale"), ("damaged", "damaged"), ("stats", "damaged"), ("dead_tmp", "temporary")):
        assert any(str(t[name]) in ln and kind in ln for ln in listed), (name, r.stdout)
    assert any(str(t["stale"]) in ln and "2.0 MB" in ln for ln in listed)
    assert "--yes" in r.stdout and all(p.exists() for p in t.values())  # listing removes nothing

    r = CliRunner().invoke(app, ["clean", "--outputs", str(out), "--yes"])
    assert r.exit_code == 0 and "removed 4 set-aside item(s)" in r.stdout, r.output
    assert {n for n, p in t.items() if p.exists()} == {"done", "partial", "live_tmp"}
    r = CliRunner().invoke(app, ["clean", "--outputs", str(out)])
    assert r.exit_code == 0 and "nothing set aside" in r.stdout


def test_clean_takes_the_workflows_options_and_checks_them(tmp_path):
    out = tmp_path / "o"
    t = _tree(out)
    r = CliRunner().invoke(app, ["clean", "--preset", "tiny", "--set", "train.lr=1e-3", "--outputs", str(out)],
                           terminal_width=400)
    assert r.exit_code == 0 and str(t["stale"]) in r.stdout and "4 set-aside item(s)" in r.stdout, r.output
    for bad, named in ((["--preset", "no_such_preset"], "no_such_preset"), (["--set", "train.lr=abc"], "train.lr")):
        r = CliRunner().invoke(app, ["clean", "--preset", "tiny", *bad, "--outputs", str(out)])
        assert r.exit_code == 2 and r.output.startswith("error: ") and named in r.output.splitlines()[0], r.output
    assert all(p.exists() for p in t.values())
