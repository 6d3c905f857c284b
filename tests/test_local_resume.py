"""PretrainLocal on the tiny local preset: SIGKILL mid-run then a rerun ends byte-identical to an
uninterrupted run; a non-finite loss fails it at once and leaves no output folder."""
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import kill_at_first_checkpoint

ROOT = Path(__file__).resolve().parents[1]
LONG = "study.K=[1,2] study.aux=[mlp] study.mtp=[first] train.token_budget=8192 train.checkpoint_every=4"  # 64 steps


def _cmd(out, over=LONG):
    return [sys.executable, "-m", "luigi", "--module", "workflows", "LocalLearningStudy", "--local-scheduler",
            "--preset", "local_tiny", "--outputs", str(out), "--set", over]


def _weights(out):
    return {p.relative_to(out).as_posix(): p.read_bytes()
            for pat in ("PretrainLocal/*/model/model.safetensors", "PretrainLocal/*/aux_heads.safetensors")
            for p in sorted(Path(out).glob(pat))}


def test_sigkill_mid_pretrain_local_resumes_to_identical_bytes(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ref, out = tmp_path / "ref", tmp_path / "killed"
    r = subprocess.run(_cmd(ref), cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    kill_at_first_checkpoint(_cmd(out), ROOT, env, out / "PretrainLocal/*.partial/checkpoint.pt")
    assert not list(out.glob("LocalStudyReport/*"))  # it really died before the end
    rerun = subprocess.run(_cmd(out), cwd=ROOT, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed from step" in rerun.stdout + rerun.stderr
    got, want = _weights(out), _weights(ref)
    assert len(want) == 4 and got == want  # byte-identical model and aux-head (with MTP) weights
    assert not list(out.glob("PretrainLocal/*.partial"))


def test_pretrain_local_with_exploding_lr_fails_with_a_message_and_leaves_no_output(tmp_path):
    out = tmp_path / "o"
    r = subprocess.run(_cmd(out, "study.K=[1] train.lr=1e9 train.grad_clip=0 train.checkpoint_every=1"), cwd=ROOT,
                       capture_output=True, text=True)
    log = r.stdout + r.stderr
    assert r.returncode != 0
    assert re.search(r"NonFiniteError: PretrainLocal K1-e2e-s0: (block 0's ce loss|the gradient norm) is (nan|inf) "
                     r"at step \d+ of 8", log) and "Lower train.lr (now 1e+09)" in log
    assert not [p for p in out.glob("PretrainLocal/*") if not p.name.endswith(".partial")]
    assert list(out.glob("PretrainLocal/*.partial/checkpoint.pt"))
    assert not list(out.glob("EvaluateLocal/*")) and not list(out.glob("LocalStudyReport/*"))
