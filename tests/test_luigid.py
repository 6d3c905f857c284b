"""Scale-out on Luigi's central scheduler: two worker processes against one luigid."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_cfg
from workflows.cli import walk
from workflows.experiment import build_experiment, load_config
from workflows.luigid import api, free_port, start_luigid

ROOT = Path(__file__).resolve().parents[1]
CFG = tiny_cfg(**{"train.max_steps": 150, "boundary.num_blocks": 2})


@pytest.fixture
def luigid(tmp_path):
    port = free_port()
    proc = start_luigid(tmp_path, port)
    try:
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def worker_cmd(out, port=None):
    sched = ["--local-scheduler"] if port is None else ["--scheduler-host", "127.0.0.1", "--scheduler-port", str(port),
                                                       "--no-lock"]
    return [sys.executable, "-m", "luigi", "--module", "workflows", "RunExperiment", *sched,
            "--preset", "", "--outputs", str(out), "--set", CFG]


def test_two_workers_share_one_luigid(tmp_path, luigid):
    out, ref = tmp_path / "shared", tmp_path / "single"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    files = [open(tmp_path / f"worker{i}.log", "w+") for i in range(2)]  # files, not pipes: a full pipe blocks a worker
    procs = [subprocess.Popen(worker_cmd(out, luigid), cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT) for f in files]
    for p in procs:
        p.wait(timeout=600)
    logs = [(tmp_path / f"worker{i}.log").read_text() for i in range(2)]
    # a worker that finds the rest held by the other exits with luigi.cfg's already_running code
    # (10), never 0 with work undone; the one that finishes the root task exits 0
    codes = sorted(p.returncode for p in procs)
    assert codes in ([0, 0], [0, 10]), logs[0][-3000:] + logs[1][-3000:]

    # each TrainBlock ran exactly once, across both workers
    ran = [line for log in logs for line in log.splitlines() if "[TrainBlock " in line and "trained" in line]
    labels = sorted(line.split("[TrainBlock ")[1].split("]")[0] for line in ran)
    assert labels == [f"block{i}-clean-cached-s0" for i in range(2)]

    # byte-identical to a single-worker run
    assert subprocess.run(worker_cmd(ref), cwd=ROOT, env=env, capture_output=True).returncode == 0
    shared = sorted(out.glob("Assemble/*/model/model.safetensors"))
    single = sorted(ref.glob("Assemble/*/model/model.safetensors"))
    assert len(shared) == 1 and shared[0].read_bytes() == single[0].read_bytes()

    # luigid knows every task as DONE, with the expected dependency edges
    done = api(luigid, "task_list", {"status": "DONE"})
    root = build_experiment(load_config(overrides=CFG, preset=""), str(out))
    deps = api(luigid, "dep_graph", {"task_id": root.task_id})
    graph = walk(root)
    assert len(graph) == 7
    for t in graph:
        assert t.task_id in done, t.task_id
        assert deps[t.task_id]["status"] == "DONE"
        assert sorted(deps[t.task_id]["deps"]) == sorted(d.task_id for d in t.deps())
    assert sum(1 for tid in done if tid.startswith("TrainBlock_")) == 2
