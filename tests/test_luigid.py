"""Scale-out on Luigi's central scheduler: two worker processes against one luigid."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import tiny_cfg
from workflows.cli import walk
from workflows.experiment import build_experiment, load_config
from luigid_util import api, free_port, start_luigid

ROOT = Path(__file__).resolve().parents[1]
# each TrainBlock takes several seconds, longer than a waiting worker's poll interval (luigi.cfg:
# wait_interval + wait_jitter = at most 1.5 s), so the two workers must share the blocks
CFG = tiny_cfg(**{"train.max_steps": 1500, "train.checkpoint_every": 500, "boundary.num_blocks": 2})


@pytest.fixture
def luigid(tmp_path):
    port = free_port()
    proc = start_luigid(tmp_path, port)
    try:
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def worker_cmd(out, port=None, cfg=CFG):
    sched = ["--local-scheduler"] if port is None else ["--scheduler-host", "127.0.0.1", "--scheduler-port", str(port),
                                                       "--no-lock"]
    return [sys.executable, "-m", "luigi", "--module", "workflows", "RunExperiment", *sched,
            "--preset", "", "--outputs", str(out), "--set", cfg]


ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # two workers share 2 cores


def start_workers(tmp_path, out, port, n=2, cfg=CFG):
    """Start ``n`` worker commands at once against luigid; return the processes and their log files."""
    logs = [tmp_path / f"worker{i}.log" for i in range(n)]  # files, not pipes: a full pipe blocks a worker
    procs = [subprocess.Popen(worker_cmd(out, port, cfg), cwd=ROOT, env=ENV, stdout=open(log, "w"),
                              stderr=subprocess.STDOUT) for log in logs]
    return procs, logs


def run_workers(tmp_path, out, port, n=2, cfg=CFG, timeout=600):
    """Run ``n`` worker commands at once against luigid; return their exit codes and logs."""
    procs, logs = start_workers(tmp_path, out, port, n, cfg)
    for p in procs:
        p.wait(timeout=timeout)
    return [p.returncode for p in procs], [log.read_text() for log in logs]


def test_two_workers_share_one_luigid(tmp_path, luigid):
    out, ref = tmp_path / "shared", tmp_path / "single"
    codes, logs = run_workers(tmp_path, out, luigid)
    # both exit 0: the experiment is complete at the end (workflows/ending.py), although Luigi saw
    # the other worker run part of what each scheduled (its own code: 10 or 25)
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert all(log.rstrip().splitlines()[-1].startswith("Report: ") for log in logs)

    # each TrainBlock ran exactly once, and the waiting worker took one: the blocks ran in parallel
    ran = [[line.split("[TrainBlock ")[1].split("]")[0] for line in log.splitlines()
            if "[TrainBlock " in line and "trained" in line] for log in logs]
    assert sorted(label for r in ran for label in r) == [f"block{i}-clean-cached-s0" for i in range(2)]
    assert sorted(len(r) for r in ran) == [1, 1], ran

    # byte-identical to a single-worker run
    assert subprocess.run(worker_cmd(ref), cwd=ROOT, env=ENV, capture_output=True).returncode == 0
    shared = sorted(out.glob("Assemble/*/model/model.safetensors"))
    single = sorted(ref.glob("Assemble/*/model/model.safetensors"))
    assert len(shared) == 1 and shared[0].read_bytes() == single[0].read_bytes()

    # luigid knows every task as DONE, with the expected dependency edges
    done = api(luigid, "task_list", {"status": "DONE"})
    root = build_experiment(load_config(overrides=CFG, preset=""), str(out))
    deps = api(luigid, "dep_graph", {"task_id": root.task_id})
    graph = walk(root)
    assert len(graph) == 13  # with the cache's two shards (train, val) and the four scoring tasks
    for t in graph:
        assert t.task_id in done, t.task_id
        assert deps[t.task_id]["status"] == "DONE"
        assert sorted(deps[t.task_id]["deps"]) == sorted(d.task_id for d in t.deps())
    assert sum(1 for tid in done if tid.startswith("TrainBlock_")) == 2


def test_a_failed_task_stops_every_waiting_worker(tmp_path, luigid):
    """A task that raises is disabled at once by the worker that ran it (workflows/failover.py), so
    the worker waiting on it exits non-zero at once (10: Luigi counts it as work held by another
    worker) instead of waiting for a retry; ``zerograph status`` then exits 1."""
    from typer.testing import CliRunner

    from workflows.cli import app

    cfg = tiny_cfg() + " device=cuda:7"  # fails inside BoundaryShard.run: no such device here
    codes, logs = run_workers(tmp_path, tmp_path / "out", luigid, cfg=cfg, timeout=120)
    # every task on the device fails (BoundaryShard, and the teacher's and untrained student's scoring, which
    # can run beside it): a worker exits 30 when a task it ran failed, else 10, or 25 if it reached the
    # scheduler only after the task was disabled; none waits for a retry (run_workers' timeout)
    assert codes.count(30) >= 1 and set(codes) - {30} <= {10, 25}, codes
    assert "cuda:7" in "".join(logs)
    r = CliRunner().invoke(app, ["status", "--preset", "", "--set", cfg, "--outputs", str(tmp_path / "out")])
    assert r.exit_code == 1 and " missing " in r.stdout


def test_a_killed_worker_is_replaced_and_the_survivor_completes_the_graph(tmp_path):
    """SIGKILL the worker running TrainBlock 0 after its first checkpoint: luigid fails that task once
    it stops hearing from the worker (``worker_disconnect_delay``: 5 s here, Luigi's default 60 s)
    and hands it to the other worker ``retry_delay`` later; that one resumes block 0 from its
    checkpoint, completes the whole graph and exits 0, and every weight file, the final optimizer
    state and the assembled model are byte-identical to a one-worker run's."""
    from typer.testing import CliRunner

    from workflows.cli import app

    port = free_port()
    luigid = start_luigid(tmp_path, port, scheduler={"worker_disconnect_delay": "5", "retry_delay": "1"})
    try:
        out, ref = tmp_path / "out", tmp_path / "ref"
        cfg = tiny_cfg(**{"train.max_steps": 2500, "train.checkpoint_every": 250, "boundary.num_blocks": 2})
        procs, logs = start_workers(tmp_path, out, port, cfg=cfg)
        deadline = time.time() + 120
        victim = None
        while victim is None and time.time() < deadline:
            if list(out.glob("TrainBlock/block0-*.partial/checkpoint.pt")):
                victim = next((i for i, log in enumerate(logs) for line in log.read_text().splitlines()
                               if line.startswith("TrainBlock block0-") and ": training " in line), None)
            time.sleep(0.05)
        assert victim is not None, "block 0 never wrote a checkpoint"
        procs[victim].kill()
        survivor = procs[1 - victim]
        survivor.wait(timeout=600)
        text = logs[1 - victim].read_text()
        assert survivor.returncode == 0, text[-3000:]
        assert "resumed from step" in text and "[TrainBlock block0-" in text  # it took block 0 over
        assert text.rstrip().splitlines()[-1].startswith("Report: ")
        status = ["status", "--preset", "", "--set", cfg, "--outputs", str(out)]
        assert CliRunner().invoke(app, status).exit_code == 0

        assert subprocess.run(worker_cmd(ref, cfg=cfg), cwd=ROOT, env=ENV, capture_output=True).returncode == 0
        for pattern in ("TrainBlock/*/block.safetensors", "TrainBlock/*/train_state.pt", "Assemble/*/model/model.safetensors"):
            a, b = sorted(out.glob(pattern)), sorted(ref.glob(pattern))
            assert len(a) == len(b) >= 1 and [x.read_bytes() for x in a] == [y.read_bytes() for y in b], pattern
    finally:
        luigid.terminate()
        luigid.wait(timeout=20)


def test_two_workers_build_the_shards_once_and_identical_to_one_worker(tmp_path, luigid):
    """With the corpus tokenised, every worker schedules the cache's shards (static requirements):
    two workers on one luigid build 4 shards, each once, byte-identical to a one-worker build."""
    import luigi

    cfg = tiny_cfg(**{"boundary.shard_sequences": 32, "train.max_steps": 4})  # train 0-32, 32-64, 64-86; val 0-10
    out, ref = tmp_path / "shared", tmp_path / "single"
    from workflows import PrepareInputs

    for o in (out, ref):  # PrepareTeacher and PrepareCorpus first, so that the shard plan is known
        assert luigi.build([PrepareInputs(preset="", set=cfg, outputs=str(o))], local_scheduler=True, log_level="WARNING")
        assert list(o.glob("PrepareCorpus/*/tokens.h5")) and not list(o.glob("BoundaryShard/*"))
    from typer.testing import CliRunner

    from workflows.cli import app

    codes, logs = run_workers(tmp_path, out, luigid, cfg=cfg)
    # a shard takes milliseconds here, so a worker may never see the other one running a shard it had
    # scheduled (Luigi: "not granted run permission", 25); the experiment is complete, so both exit 0
    assert codes == [0, 0], (codes, logs[0][-3000:] + "\n-----\n" + logs[1][-5000:])
    assert CliRunner().invoke(app, ["status", "--preset", "", "--set", cfg, "--outputs", str(out)]).exit_code == 0
    built = [line.split("[BoundaryShard ")[1].split("]")[0] for log in logs for line in log.splitlines()
             if "[BoundaryShard " in line and "] built" in line]
    assert sorted(built) == ["train-00000000-00000032", "train-00000032-00000064", "train-00000064-00000086",
                             "val-00000000-00000010"]  # each shard built exactly once, by one of the workers
    done = api(luigid, "task_list", {"status": "DONE"})
    assert sum(1 for tid in done if tid.startswith("BoundaryShard_")) == 4  # luigid's graph shows the shards

    assert subprocess.run(worker_cmd(ref, cfg=cfg), cwd=ROOT, env=ENV, capture_output=True).returncode == 0
    files = lambda o: {p.relative_to(o / "BoundaryShard").as_posix(): p.read_bytes()
                       for p in sorted((o / "BoundaryShard").glob("*/b*.h5"))}
    assert files(out) == files(ref) and len(files(out)) == 12  # 4 shards x 3 boundaries, byte for byte
    model = lambda o: next(o.glob("Assemble/*/model/model.safetensors")).read_bytes()
    assert model(out) == model(ref)
