"""What a killed writer leaves behind: temporary names record their writer's host and pid, and a
task removes its dead writers' leftovers when it next runs."""
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import tiny_cfg
from zgcore.atomic import atomic_path, is_stale, remove_stale_temps, temp_writer, this_host, tmp_sibling

ROOT = Path(__file__).resolve().parents[1]
CFG = tiny_cfg(**{"train.max_steps": 40, "train.checkpoint_every": 10})
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}

# A writer of a real task's output, SIGKILLed in the middle: it enters the task's own `building()`
# (or, for a TrainBlock, the loop's atomic checkpoint write in its work folder), writes, and dies.
KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
from workflows.cli import walk
from workflows.experiment import build_experiment, load_config
from zgcore.atomic import atomic_path
family, out = sys.argv[1], sys.argv[2]
task = next(t for t in walk(build_experiment(load_config(overrides=sys.argv[3], preset=""), out))
            if t.get_task_family() == family)
if sys.argv[4] == "checkpoint":
    task.work_dir.mkdir(parents=True, exist_ok=True)
    ctx = atomic_path(task.work_dir / "checkpoint.pt")
else:
    ctx = task.building()
with ctx as tmp:  # building() yields a folder it made, atomic_path a file name
    (tmp / "half.bin" if tmp.is_dir() else tmp).write_bytes(b"x" * 4096)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_temporary_names_record_their_writer_and_only_dead_writers_are_stale(tmp_path):
    t = tmp_sibling(tmp_path / "report-abc")
    assert t.name.startswith(".report-abc.tmp-") and temp_writer(t.name) == (this_host(), os.getpid())
    assert temp_writer(".report-abc.tmp-1234-0a1b2c3d") == (None, 1234)  # written before the host was recorded
    assert temp_writer("report-abc") is None and temp_writer(".report-abc.partial") is None
    t.mkdir()
    assert not is_stale(t)  # this process: alive
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f".report-abc.tmp-{this_host()}-{int(dead.stdout)}-0a1b2c3d"
    gone.mkdir()
    assert is_stale(gone)
    far = tmp_path / ".report-abc.tmp-othernode-4242-0a1b2c3d"  # another host: judged by age only
    far.mkdir()
    (far / "f").write_text("x")
    assert not is_stale(far, max_age_s=3600)
    old = time.time() - 7200
    for p in (far, far / "f"):
        os.utime(p, (old, old))
    assert is_stale(far, max_age_s=3600) and not is_stale(far, max_age_s=3 * 3600)
    assert sorted(p.name for p in remove_stale_temps(tmp_path, "report-abc", max_age_s=3600)) == sorted([gone.name, far.name])
    assert t.is_dir() and not gone.exists() and not far.exists()
    with atomic_path(tmp_path / "x.json") as tmp:  # a live writer's temp is never removed
        tmp.write_text("{}")
        assert remove_stale_temps(tmp_path) == [] and tmp.exists()


def test_writers_sigkilled_mid_task_leave_nothing_after_the_next_run(tmp_path):
    """Three writers of the tiny graph's tasks are SIGKILLed while writing (the Evaluate report's
    output folder, a TrainBlock's output folder, a TrainBlock checkpoint in its work folder), and a
    writer on another host died a day ago; the next run removes every one of their temporary
    names, says so, and completes. A recent temporary name of another host (a writer that may be
    alive there) is kept."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "luigi", "--module", "workflows", "RunExperiment", "--local-scheduler",
           "--preset", "", "--outputs", str(out), "--set", CFG]
    for family, what in (("Evaluate", "output"), ("TrainBlock", "output"), ("TrainBlock", "checkpoint")):
        r = subprocess.run([sys.executable, "-c", KILLED_WRITER, family, str(out), CFG, what], cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == -9, r.stderr[-2000:]  # killed mid-write
    temps = lambda: sorted(p for p in out.rglob("*") if temp_writer(p.name))  # noqa: E731
    left = temps()
    assert len(left) == 3, left
    assert {p.parent.name for p in left} >= {"Evaluate", "TrainBlock"} and any(".partial" in str(p) for p in left)
    report_dir = left[0].parent  # another host's writers: one dead a day ago, one perhaps alive
    old = report_dir / f".{left[0].name.split('.tmp-')[0][1:]}.tmp-othernode-77-0a1b2c3d"
    fresh = report_dir / f".{left[0].name.split('.tmp-')[0][1:]}.tmp-othernode-78-0a1b2c3d"
    for p in (old, fresh):
        p.mkdir()
    os.utime(old, (time.time() - 2 * 86400,) * 2)

    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert temps() == [fresh], temps()
    said = [line for line in (r.stdout + r.stderr).splitlines() if "left by a writer that no longer runs" in line]
    assert len(said) == 4, said
    assert list(out.glob("Evaluate/*/report.md")) and len(list(out.glob("TrainBlock/*/block.safetensors"))) == 2


def test_verify_checks_every_output_file_and_clean_removes_dead_writers_leftovers(tmp_path):
    """`zerograph verify` reads every file of every finished output in full against its task.json
    SHA-256 (not the per-process cache): a byte flipped in block 0's weights (same size and
    modification time) is named, exit 1, and the block's folder moved aside; `--clean` first
    removes a temporary folder whose writer died, and keeps a live writer's."""
    import luigi
    from typer.testing import CliRunner

    from workflows import RunExperiment
    from workflows.cli import app

    out = tmp_path / "out"
    cfg = tiny_cfg(**{"train.max_steps": 3})
    assert luigi.build([RunExperiment(preset="", set=cfg, outputs=str(out))], local_scheduler=True, log_level="WARNING")
    args = ["verify", "--preset", "", "--set", cfg, "--outputs", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and "all whole" in r.output, r.output

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = out / "Evaluate" / f".report-x.tmp-{this_host()}-{int(dead.stdout)}-0a1b2c3d"
    alive = out / "Evaluate" / f".report-x.tmp-{this_host()}-{os.getpid()}-0a1b2c3d"
    for p in (gone, alive):
        p.mkdir()
    (f,) = sorted(out.glob("TrainBlock/block0-*/block.safetensors"))
    st, raw = f.stat(), bytearray(f.read_bytes())
    raw[-10] ^= 0x01
    f.write_bytes(raw)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = CliRunner().invoke(app, [*args, "--clean"])
    assert r.exit_code == 1, r.output
    assert f"removed {gone}" in r.output and not gone.exists() and alive.is_dir()
    damaged = [line for line in r.output.splitlines() if line.startswith("damaged: ")]
    assert len(damaged) == 1 and str(f) in damaged[0] and "SHA-256" in damaged[0], r.output
    assert not f.parent.exists() and list(f.parent.parent.glob(f"{f.parent.name}.damaged-*"))
