"""Luigi's sharp edges, wrapped (workflows/ending.py): without --local-scheduler and with no luigid
answering, the `luigi` command fails in one line, at once, naming both fixes; SIGTERM (Slurm's
pre-emption) ends a run as Ctrl-C does: one line, exit 143, the checkpoint kept, and the same
command resumes it to the bytes of an uninterrupted run."""
from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from workflows.ending import NO_SCHEDULER_EXIT, TERMINATED, TERMINATED_EXIT

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k != "LUIGI_CONFIG_PATH"} | {
    "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _luigi(out, *extra):
    return [sys.executable, "-m", "luigi", "--module", "workflows", "RunExperiment", "--preset", "tiny",
            "--outputs", str(out), *extra]


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on leaving: nothing listens there


def test_no_scheduler_fails_in_one_line_at_once_naming_both_fixes(tmp_path):
    t0 = time.monotonic()  # the same imports, no scheduler looked for: what start-up alone costs
    subprocess.run([*_luigi(tmp_path / "o"), "--help"], cwd=tmp_path, env=ENV, capture_output=True, timeout=120)
    startup = time.monotonic() - t0
    t0 = time.monotonic()
    r = subprocess.run(_luigi(tmp_path / "o", "--scheduler-host", "127.0.0.1", "--scheduler-port", str(_dead_port())),
                       cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    spent = time.monotonic() - t0 - startup
    lines = r.stderr.strip().splitlines()
    assert r.returncode == NO_SCHEDULER_EXIT == 2 and len(lines) == 1, r.stderr[-2000:]
    assert "--local-scheduler" in lines[0] and "luigid" in lines[0] and "default-scheduler-url" in lines[0]
    # no retry loop: at most about one more start-up (a loaded machine slows both alike), never luigi's retries
    assert spent < max(5.0, 1.5 * startup), f"{spent:.1f} s beyond a {startup:.1f} s start-up before the scheduler error"
    assert not (tmp_path / "o").exists()  # nothing ran


def _digests(out: Path) -> dict[str, str]:
    return {p.parent.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.glob("TrainBlock/*/block.safetensors")) if "." not in p.parent.name}


def test_sigterm_mid_trainblock_ends_in_one_line_and_resumes_to_the_same_bytes(tmp_path):
    over = ["--set", "train.max_steps=200 train.checkpoint_every=10", "--local-scheduler"]
    ref, out = tmp_path / "ref", tmp_path / "o"
    r = subprocess.run(_luigi(ref, *over), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    # its own process group, as a Slurm job step: SIGTERM reaches the run and its prefetch workers alike
    p = subprocess.Popen(_luigi(out, *over), cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and not list(out.glob("TrainBlock/*.partial/checkpoint.pt")) and p.poll() is None:
        time.sleep(0.02)
    assert p.poll() is None, "the run ended before its first checkpoint"
    os.killpg(p.pid, signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == TERMINATED_EXIT == 143, err[-3000:]
    assert err.rstrip().splitlines()[-1] == TERMINATED and "Traceback" not in err
    assert list(out.glob("TrainBlock/*.partial/checkpoint.pt")), "the checkpoint was not kept"
    r = subprocess.run(_luigi(out, *over), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "resumed from step" in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    got, want = _digests(out), _digests(ref)
    assert len(want) == 2 and got == want
