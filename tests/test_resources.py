"""What tasks tell the scheduler: GPU capping (tasks working on a CUDA device claim the Luigi
resource ``gpu``; CPU work claims none), the retry policy, and throttled progress reports."""
import pytest

import tasks.base

from tests.conftest import tiny_cfg
from workflows.cli import walk
from workflows.experiment import build_experiment, load_config


def graph(tmp_path, extra=""):
    return walk(build_experiment(load_config(overrides=tiny_cfg() + extra, preset=""), str(tmp_path)))


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_tasks_claim_one_gpu(tmp_path, device):
    tasks = graph(tmp_path, f" device={device}")
    for t in tasks:
        want = {"gpu": 1} if t.uses_device and t.device.startswith("cuda") else {}
        assert t.resources == want, t.task_id
        assert t.process_resources() == want  # what the worker sends to the scheduler
    claims = {t.get_task_family(): t.resources for t in tasks}
    assert claims["TrainBlock"] == claims["Assemble"] == claims["ScoreTeacher"] == claims["ScoreAssembled"] == {"gpu": 1}
    assert claims["Evaluate"] == {}  # the join reads scores only
    assert claims["TeacherBoundary"] == {}  # the join reads shard records only
    from tasks.cache import BoundaryShard

    tb = next(t for t in tasks if t.get_task_family() == "TeacherBoundary")
    shard = BoundaryShard(teacher=tb.teacher, corpus=tb.corpus, boundary=tb.boundary, split="train", lo=0, hi=8,
                          outputs=tb.outputs, device=device)
    assert shard.resources == {"gpu": 1}  # the teacher forward runs on the experiment's device
    assert claims["PrepareTeacher"] == claims["PrepareCorpus"] == {}  # CPU-only steps never hold a GPU slot
    assert sum(t.resources == {"gpu": 1} for t in tasks if t.get_task_family() == "TrainBlock") == 2


def test_cpu_tasks_claim_nothing(tmp_path):
    assert all(t.resources == {} for t in graph(tmp_path))


def test_seed_summary_claims_no_gpu(tmp_path):
    tasks = graph(tmp_path, " device=cuda seeds=[0,1]")
    root = tasks[-1]
    assert root.get_task_family() == "SeedSummary" and root.device == "cuda" and root.resources == {}
    evals = [t for t in tasks if t.get_task_family() == "Evaluate"]
    assert len(evals) == 2 and all(t.resources == {} for t in evals)  # joins: the scoring tasks hold the GPU
    assert all(t.resources == {"gpu": 1} for t in tasks if t.get_task_family() == "ScoreAssembled")


def test_a_task_that_raises_is_disabled_at_once_and_a_lost_workers_task_goes_to_another(tmp_path):
    """Luigi's scheduler, as luigid runs it: a ZeroGraph task that raises is disabled after its first
    failure (its worker reports it DISABLED: workflows/failover.py), and a rerun's worker enables it
    again; a task whose worker stops answering is failed by the scheduler, PENDING again after
    retry_delay and given to another worker (ZGTask.retry_count = 3 losses)."""
    import time

    import luigi.scheduler as ls
    import luigi.worker

    import workflows  # noqa: F401 (installs the failover report)
    from tasks.base import ZGTask

    assert all(t.retry_count == 3 for t in graph(tmp_path))  # sent to the scheduler with every task

    class RaisesOnce(ZGTask):
        def own_config(self):
            return {}

        def run(self):
            raise ValueError("a real error")

    sch = ls.Scheduler(retry_delay=0.0, worker_disconnect_delay=5.0)
    task = RaisesOnce(outputs=str(tmp_path))
    with luigi.worker.Worker(scheduler=sch, worker_processes=1, keep_alive=True, wait_interval=0.01) as w:
        w.add(task)
        assert not w.run()  # returns at once: nothing left to wait for, no retry
    st = sch._state.get_task(task.task_id)
    assert st.status == ls.DISABLED and st.scheduler_disable_time is None  # the worker's disable, not a timed one
    sch.prune()
    assert sch._state.get_task(task.task_id).status == ls.DISABLED  # retry_delay 0 s: still not retried
    sch.add_task(worker="rerun", task_id=task.task_id, status=ls.PENDING, runnable=True)
    assert sch._state.get_task(task.task_id).status == ls.PENDING  # a rerun enables it again

    policy = {"retry_count": ZGTask.retry_count}
    for wid in ("lost", "survivor"):
        sch.add_task(worker=wid, task_id="TrainBlock_x", status=ls.PENDING, runnable=True, retry_policy_dict=policy)
    assert sch.get_work(worker="lost")["task_id"] == "TrainBlock_x"
    sch._state.get_worker("lost").last_active = time.time() - 60  # no ping for 60 s: its job was killed
    sch.prune()  # what luigid does on every request (prune_on_get_work, luigi.cfg)
    st = sch._state.get_task("TrainBlock_x")
    assert st.status in (ls.FAILED, ls.PENDING) and st.num_failures() == 1  # failed once, not disabled
    assert sch.get_work(worker="survivor")["task_id"] == "TrainBlock_x"  # retry_delay (0 s here) later
    assert st.worker_running == "survivor"


def test_progress_reports_are_throttled(tmp_path, monkeypatch):
    """Each report is two scheduler calls (HTTP with luigid): at most one per PROGRESS_INTERVAL_S
    (2 s) plus the final one, not one per training step."""
    block = next(t for t in graph(tmp_path) if t.get_task_family() == "TrainBlock")
    sent = []
    monkeypatch.setattr(block, "set_progress_percentage", sent.append)
    monkeypatch.setattr(block, "set_status_message", lambda m: sent.append(m))
    clock = iter([100.0, 100.5, 101.0, 102.5, 103.0, 103.1])
    monkeypatch.setattr(tasks.base.time, "monotonic", lambda: next(clock))
    for step in range(1, 7):
        block.progress(step, 6, f"step {step}/6")
    assert sent == [16, "step 1/6", 66, "step 4/6", 100, "step 6/6"]
