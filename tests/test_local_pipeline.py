"""Local learning with one process per block (train.execution = "pipeline") on the tiny preset: the sync
schedule gives per_block's weights bit for bit (K=2, K=4); the asynchronous one records a staleness
within its bound; a stage killed with SIGKILL fails the task in one line naming it and leaves no stage
running, and a rerun resumes to per_block's bytes; bad input fails before any process starts."""
import csv
import json
import os
import signal
import threading
import time
from pathlib import Path

import luigi
import pytest

from tasks.local import PretrainLocal
from workflows.local import load_local_config
from zgcore import local as zl
from zgcore.checks import ConfigError
from zgcore.local import pipeline as zp
from zgcore.local.stage import HOLD_ENV

CFG = "study.K=[1] train.checkpoint_every=2 train.tensorboard=false"


@pytest.fixture(autouse=True)
def enough_cores(monkeypatch):
    """K stages need K cores; this test machine may have fewer (the stages only time-share)."""
    monkeypatch.setattr(zp, "usable_cores", lambda: 8)


def _task(out: Path, k: int, execution: str, sync: bool = True) -> PretrainLocal:
    cfg = load_local_config("", CFG, "local_tiny")
    run = zl.normalise_run({"model": cfg["model"], "local": {**cfg["local"], "K": k, "aux": "mlp"},
                            "train": {**cfg["train"], "execution": execution, "pipeline_sync": sync}})
    return PretrainLocal(tokenizer=cfg["tokenizer"], corpus=cfg["corpus"], setup=run, outputs=str(out),
                         checkpoint_every=2, tensorboard=False)


def _run(task: PretrainLocal) -> None:
    """``task.run()`` in this process, so that an error reaches the test as it is raised."""
    task.set_progress_percentage = task.set_status_message = lambda *a: None  # no scheduler to report to
    task.run()


def _build(task: PretrainLocal) -> None:
    assert luigi.build([task.requires()], local_scheduler=True, workers=1, log_level="WARNING")
    _run(task)


def _weights(task: PretrainLocal) -> dict[str, bytes]:
    return {n: (task.out_dir / n).read_bytes() for n in ("model/model.safetensors", "aux_heads.safetensors")}


@pytest.mark.parametrize("k", [2, 4])
def test_sync_pipeline_gives_per_block_weights_bit_for_bit(tmp_path, k):
    ref, pipe = _task(tmp_path, k, "per_block"), _task(tmp_path, k, "pipeline")
    _build(ref)
    _build(pipe)
    assert _weights(pipe) == _weights(ref)
    m = json.loads((pipe.out_dir / "metrics.json").read_text())
    assert m["execution"] == "pipeline" and m["staleness_max"] == [0.0] * k and len(m["stages"]) == k
    assert m["tokens_sha256"] == json.loads((ref.out_dir / "metrics.json").read_text())["tokens_sha256"]
    assert all(0 <= s["idle_share"] <= 1 and s["peak_rss_bytes"] > 0 for s in m["stages"])
    assert sorted(p.name for p in pipe.out_dir.glob("train_state_stage*.pt")) == [f"train_state_stage{j}.pt" for j in range(k)]


def test_async_pipeline_records_staleness_within_its_bound(tmp_path):
    task = _task(tmp_path, 4, "pipeline", sync=False)
    _build(task)
    with open(task.out_dir / "loss_log.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8
    for j in range(4):  # block j (0-based) trains on input at most j steps old; block 0 on its own batch
        stale = [float(r[f"staleness_b{j + 1}"]) for r in rows]
        assert all(0 <= s <= j for s in stale) and (j > 0 or set(stale) == {0.0})
        assert all(float(r[f"idle_s_b{j + 1}"]) >= 0 for r in rows)
    m = json.loads((task.out_dir / "metrics.json").read_text())
    assert m["pipeline_sync"] is False and len(m["staleness_max"]) == 4 and m["staleness_max"][0] == 0.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_killed_stage_fails_in_one_line_and_a_rerun_resumes_to_per_block_bytes(tmp_path, monkeypatch):
    ref, task = _task(tmp_path, 2, "per_block"), _task(tmp_path, 2, "pipeline")
    _build(ref)
    assert luigi.build([task.requires()], local_scheduler=True, workers=1, log_level="WARNING")
    monkeypatch.setenv(HOLD_ENV, "1:3")  # stage 1 stops after step 3 (its checkpoint of step 2 is written)
    pids: list[int] = []

    def kill_stage_1():
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                pids[:] = json.loads((task.work_dir / zp.PIDS).read_text())["pids"]
            except (OSError, ValueError):
                time.sleep(0.2)
                continue
            if (task.work_dir / "stage1" / "checkpoint-00000002.pt").exists():
                time.sleep(1.0)
                os.kill(pids[1], signal.SIGKILL)
                return
            time.sleep(0.2)
    killer = threading.Thread(target=kill_stage_1)
    killer.start()
    with pytest.raises(zp.PipelineStageError) as e:
        _run(task)
    killer.join()
    msg = str(e.value)
    assert "\n" not in msg and "pipeline stage 1 (block 1" in msg and "killed by SIGKILL" in msg
    assert msg.endswith("a rerun resumes from step 2") and len(pids) == 2
    assert not any(_alive(p) for p in pids)  # no stage left running
    assert not task.out_dir.exists()
    monkeypatch.delenv(HOLD_ENV)
    _run(task)
    m = json.loads((task.out_dir / "metrics.json").read_text())
    assert m["resumed_from"] == 2
    assert _weights(task) == _weights(ref)


def test_bad_pipeline_input_fails_before_any_process_starts():
    t = {**zl.LOCAL_DEFAULTS["train"], "execution": "pipeline"}
    with pytest.raises(ConfigError, match=r"local.K=4 pipeline stages need 4 CPU cores .* may use 2"):
        zp.check_pipeline(4, "cpu", t, cores=2)
    with pytest.raises(ConfigError, match=r"device=mps has no torch.distributed backend"):
        zp.check_pipeline(2, "mps", t)
    with pytest.raises(ConfigError, match=r"needs local.K >= 2"):
        zp.check_pipeline(1, "cpu", t)
    with pytest.raises(ConfigError, match=r"train.pipeline_sync must be true or false"):
        zp.check_pipeline(2, "cpu", {**t, "pipeline_sync": "yes"})
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"device=cuda with train.execution=\"pipeline\" needs CUDA"):
            zp.check_pipeline(2, "cuda", t)
    with pytest.raises(ConfigError, match=r"pipeline_sync=false .* needs train.execution=\"pipeline\""):
        load_local_config("", "train.pipeline_sync=false train.execution=per_block", "local_tiny")
    with pytest.raises(ConfigError, match=r"device=mps has no torch.distributed backend"):
        load_local_config("", "study.K=[1,2] train.execution=pipeline device=mps", "local_tiny")
    cfg = load_local_config("", "study.K=[1,2] study.aux=[mlp] study.mtp=[off] train.execution=pipeline", "local_tiny")
    runs = {c["K"]: c["run"]["train"] for c in zl.expand_study(cfg)}
    assert runs[1]["execution"] == "per_block" and "pipeline_sync" not in runs[1]  # one block: no pipeline
    assert runs[2]["execution"] == "pipeline" and runs[2]["pipeline_sync"] is True


def test_a_stage_that_raises_names_itself_and_what_it_raised(tmp_path, monkeypatch):
    """A stage's non-finite loss comes back as the NonFiniteError the one-process run raises."""
    task = _task(tmp_path, 2, "pipeline")
    cfg = json.loads(json.dumps(task.setup, default=dict))
    cfg["train"].update(lr=1e9, grad_clip=0.0)
    task = PretrainLocal(tokenizer=task.tokenizer, corpus=task.corpus, setup=cfg, outputs=str(tmp_path),
                         checkpoint_every=2, tensorboard=False)
    from zgcore.training.loop import NonFiniteError
    with pytest.raises(NonFiniteError, match=r"PretrainLocal K2-mlp-pipe-s0 stage \d: .* is (nan|inf) at step \d+ of 8"):
        _build(task)


def test_study_arms_that_differ_only_in_execution_are_compared_run_by_run():
    from zgcore.local.findings import compared_pairs

    cfg = load_local_config(preset="local_cpu_pipeline")
    cells = zl.expand_seeds(cfg)
    assert cfg["seeds"] == [2, 3, 4] and len(cells) == 9
    arms = {zl.report.arm_name(c): c["run"]["train"] for c in cells}
    assert arms["K=2 mlp [async pipeline]"]["execution"] == "pipeline"
    assert arms["K=2 mlp [async pipeline]"]["pipeline_sync"] is False
    assert arms["K=2 mlp [per_block]"]["execution"] == "per_block" and "pipeline_sync" not in arms["K=2 mlp [per_block]"]
    assert ("K=2 mlp [async pipeline]", "K=2 mlp [per_block]") in compared_pairs(cells)
    with pytest.raises(ConfigError, match=r"study.configs\[1\].pipeline_sync=false .* needs study.configs\[1\].execution"):
        load_local_config("", {"study": {"configs": [{"K": 1}, {"K": 2, "pipeline_sync": False}]}}, "local_tiny")
    with pytest.raises(ConfigError, match=r"lists K=2, aux=mlp, mtp=off, pipeline twice"):
        load_local_config("", {"study": {"configs": [{"K": 1}, {"K": 2, "execution": "pipeline"},
                                                     {"K": 2, "aux": "mlp", "execution": "pipeline"}]}}, "local_tiny")


def test_resume_point_is_the_last_step_every_stage_saved(tmp_path):
    import torch
    from zgcore.local.stage import stage_dir
    from zgcore.training.loop import CKPT, TrainLoop

    lin = torch.nn.Linear(2, 2)
    loop = TrainLoop("t", [list(lin.parameters())], {**zl.LOCAL_DEFAULTS["train"]}, 8, None, "h", {"m": lin}, ["loss"])
    saved = {0: [2, 4, 6], 1: [2, 4], 2: [4]}  # stage 2 lost its step-2 checkpoint to pruning after all saved 4
    for j, steps in saved.items():
        for s in steps:
            loop.log = [[s, 1.0, 0.1]]
            stage_dir(tmp_path, j).mkdir(parents=True, exist_ok=True)
            loop.save(stage_dir(tmp_path, j) / f"checkpoint-{s:08d}.pt")
    (stage_dir(tmp_path, 1) / "checkpoint-00000008.pt").write_bytes(b"damaged")  # never a resume point
    assert zp.resume_point(tmp_path, 3) == 4
    for j in range(3):
        assert sorted(p.name for p in stage_dir(tmp_path, j).glob("checkpoint*.pt")) == \
            sorted([CKPT] + [f"checkpoint-{s:08d}.pt" for s in saved[j] if s <= 4])
        assert (stage_dir(tmp_path, j) / CKPT).read_bytes() == (stage_dir(tmp_path, j) / "checkpoint-00000004.pt").read_bytes()
    assert zp.resume_point(tmp_path / "fresh", 2) == 0


def test_in_a_slurm_job_of_k_tasks_the_stages_are_one_srun(tmp_path, monkeypatch):
    """A stand-in `srun` on PATH runs the K tasks here as Slurm would (SLURM_PROCID per task): the stages
    start from `python -m zgcore.local.stage`, and the result is per_block's bytes."""
    from workflows.slurm_cluster import worker_script

    fake = tmp_path / "bin" / "srun"
    fake.parent.mkdir()
    fake.write_text('#!/bin/bash\necho "$@" > "$SRUN_CALLED"\nn=1; while [[ $1 == --* ]]; do [[ $1 == --ntasks=* ]] && n=${1#--ntasks=}; shift; done\n'
                    'pids=(); for ((i=0; i<n; i++)); do SLURM_PROCID=$i "$@" & pids+=($!); done\n'
                    'rc=0; for p in "${pids[@]}"; do wait $p || rc=$?; done; exit $rc\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SRUN_CALLED", str(tmp_path / "srun-called"))
    monkeypatch.setenv("SLURM_NTASKS", "1")
    with pytest.raises(ConfigError, match=r"local.K=4 pipeline stages need 4 CPU cores"):
        zp.check_pipeline(4, "cpu", zl.LOCAL_DEFAULTS["train"], cores=2)  # one task: spawned, on its cores
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with pytest.raises(ConfigError, match=r"local.K=4 pipeline stages need 4 Slurm tasks, this job has 2: .*--tasks-per-worker 4"):
        zp.check_pipeline(4, "cpu", zl.LOCAL_DEFAULTS["train"])
    assert zp.srun_command(Path("/w/spec"), 2, 3)[:4] == ["srun", "--ntasks=2", "--kill-on-bad-exit=1", "--cpus-per-task=3"]
    script = worker_script(tmp_path, "LocalLearningStudy", [], workers=1, gpus=0, cpus=2, partition=None, time_limit=None,
                           mem=None, sched_host="h", sched_port=1, name="n", extra=[], tasks=2)
    assert "#SBATCH --ntasks=2\n" in script and "--nodes=1" not in script and "--ntasks=1" not in script
    ref, task = _task(tmp_path, 2, "per_block"), _task(tmp_path, 2, "pipeline")
    _build(ref)
    _build(task)
    assert _weights(task) == _weights(ref)
    assert (tmp_path / "srun-called").read_text().startswith("--ntasks=2 --kill-on-bad-exit=1 ")  # srun started them
