"""Kill a TrainBlock with SIGKILL mid-training; the rerun resumes and ends byte-identical."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import kill_at_first_checkpoint, tiny_cfg

ROOT = Path(__file__).resolve().parents[1]
# prefetching: the killed run had batches in flight in its prefetch worker
LONG = tiny_cfg(**{"train.max_steps": 400, "train.checkpoint_every": 10, "train.batch_size": 2, "train.prefetch": 3})


def _cmd(out, device="cpu"):
    return [sys.executable, "-m", "luigi", "--module", "workflows", "RunExperiment", "--local-scheduler",
            "--preset", "", "--outputs", str(out), "--set", LONG + f" device={device}"]


def _curves(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    curves = []
    for run in sorted(Path(out).glob("tensorboard/*/TrainBlock/*")):
        acc = EventAccumulator(str(run))
        acc.Reload()
        curves.append([(e.step, e.value) for e in acc.Scalars("loss/loss")])
    return curves


def _blocks(out, name="block.safetensors"):
    return {p.parent.name.rsplit("-", 1)[0]: p.read_bytes() for p in sorted(Path(out).glob(f"TrainBlock/*/{name}"))}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine"))])
def test_sigkill_mid_block_resumes_to_identical_bytes(tmp_path, device):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ref, out = tmp_path / "ref", tmp_path / "killed"
    assert subprocess.run(_cmd(ref, device), cwd=ROOT, env=env, capture_output=True).returncode == 0

    kill_at_first_checkpoint(_cmd(out, device), ROOT, env, out / "TrainBlock/*.partial/checkpoint.pt")
    boundary_mtime = next(out.glob("BoundaryShard/train-*/b0.h5")).stat().st_mtime_ns
    assert not list(out.glob("Evaluate/*"))  # it really died before the end

    rerun = subprocess.run(_cmd(out, device), cwd=ROOT, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    log = rerun.stdout + rerun.stderr
    assert "resumed from step" in log
    assert "[TeacherBoundary " not in log and "[BoundaryShard " not in log  # neither ran again (each says what it did when it runs)
    assert next(out.glob("BoundaryShard/train-*/b0.h5")).stat().st_mtime_ns == boundary_mtime  # cache not rebuilt
    assert _blocks(out) == _blocks(ref) and len(_blocks(ref)) == 2  # byte-identical block weights
    # and the final optimizer and RNG state: the same bytes, resumed or not
    assert _blocks(out, "train_state.pt") == _blocks(ref, "train_state.pt") and len(_blocks(ref, "train_state.pt")) == 2
    assert not list(out.glob("TrainBlock/*.partial"))
    # TensorBoard: one curve per block, steps 1..400 once each (flushed before each checkpoint; what the
    # killed run logged after its last checkpoint is purged), with the uninterrupted run's values
    assert _curves(out) == _curves(ref) and [s for s, _ in _curves(ref)[0]] == list(range(1, 401))


def test_damaged_checkpoint_and_cache_are_detected_not_used(tmp_path, run_graph):
    from workflows import RunExperiment

    cfg = tiny_cfg()
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_graph(RunExperiment(preset="", set=cfg, outputs=str(ref)))[0]
    # a truncated checkpoint left in a block's work folder
    assert run_graph(RunExperiment(preset="", set=cfg, outputs=str(out)))[0]
    block0 = next(out.glob("TrainBlock/block0-*"))
    partial = block0.with_name(block0.name + ".partial")
    partial.mkdir()
    (partial / "checkpoint.pt").write_bytes(b"PK\x03\x04 truncated")
    import shutil

    shutil.rmtree(block0)
    shutil.rmtree(next(out.glob("Evaluate/*")))
    shutil.rmtree(next(out.glob("Assemble/*")))
    ok, ran = run_graph(RunExperiment(preset="", set=cfg, outputs=str(out)))
    assert ok and ("TrainBlock", "block0-clean-cached-s0") in ran
    assert not partial.exists()
    assert _blocks(out) == _blocks(ref)
    # a truncated shard file is rebuilt (the damaged shard kept aside) as soon as a block needs it
    h5 = next(out.glob("BoundaryShard/train-*/b2.h5"))
    h5.write_bytes(h5.read_bytes()[:1000])
    ok, ran = run_graph(RunExperiment(preset="", set=cfg + " blocks.1.lr=0.003", outputs=out))
    assert ok and ("TeacherBoundary", "boundaries") in ran
    assert [f for f, _ in ran].count("BoundaryShard") == 1  # only the damaged shard, not the val one
    assert list(out.glob("BoundaryShard/train-*.damaged-*"))
    fresh = [p for p in out.glob("BoundaryShard/train-*/b2.h5") if ".damaged-" not in p.parent.name]
    assert len(fresh) == 1 and fresh[0].stat().st_size > 1000
