"""Pipelined execution of local learning (``train.execution = "pipeline"``): K processes, one block each.

Why (arXiv 2610.04867, first sentence): without a backward pass between blocks, "inter-stage
communication becomes forward-only and every block can step its optimizer independently". Each
block runs in its own process (:mod:`zgcore.local.stage`), spawned by ``torch.multiprocessing`` or,
in a Slurm job of several tasks, a task of one ``srun`` (:func:`srun_command`); they meet through a
``torch.distributed.FileStore`` in the work folder and pass messages point to point (gloo on CPU,
NCCL on CUDA, one GPU per block). ``train.pipeline_sync = true`` gives the ``per_block`` run's
weights bit for bit; ``false`` lets block ``j`` train on input up to ``j`` steps old (its
staleness, recorded per step). See ``docs/local_learning.md``.

Faults: every stage checkpoints at the same steps and keeps each checkpoint until all stages have
a later one; a (re)start restarts every stage from the last step all of them saved
(:func:`resume_point`). A stage that dies or raises fails the run with one line naming it
(:class:`PipelineStageError`), after every other stage was stopped.
"""
from __future__ import annotations

import hashlib
import math
import os
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from collections.abc import Mapping

import numpy as np
import torch

from zgcore.atomic import atomic_path, write_json
from zgcore.checks import ConfigError
from zgcore.threads import usable_cores
from zgcore.training.loop import CKPT, FINAL_STATE, LOSS_LOG, NonFiniteError, load_checkpoint
from .config import steps_for
from .stage import ERROR, RESULT, checkpoint_steps, read_record, run_stage, stage_dir
from .training import batch_indices, measure_activation_memory

PIDS = "stages.json"  # in the work folder while the stages run: their process ids


class PipelineStageError(RuntimeError):
    """A stage process of a pipelined run died or raised; every other stage was stopped.

    Attributes: ``stage`` (0-based, = its block), ``reason`` (one line)."""

    def __init__(self, message: str, stage: int, reason: str):
        super().__init__(message)
        self.stage, self.reason = stage, reason

    def __reduce__(self):
        return type(self), (str(self), self.stage, self.reason)


def slurm_tasks() -> int:
    """The tasks of the Slurm job this process runs in (``SLURM_NTASKS``), 0 outside one. With more
    than one, a pipeline starts its stages as the tasks of one ``srun`` instead of spawning them."""
    if not os.environ.get("SLURM_JOB_ID"):
        return 0
    try:
        return int(os.environ.get("SLURM_NTASKS", "0"))
    except ValueError:
        return 0


def check_pipeline(k: int, device: str, t: Mapping[str, Any], cores: int | None = None, capacity: bool = True) -> str:
    """Check that a pipelined run can start here, before anything runs; returns the backend
    (``"gloo"`` on CPU, ``"nccl"`` on CUDA).

    Raises:
        ConfigError: ``K < 2`` (one block: use ``per_block``); a device with no ``torch.distributed``
            backend here (anything but CPU with gloo and CUDA with NCCL); more blocks than the host
            gives processes: CUDA devices (one per block) or usable CPU cores (its affinity and
            cgroup quota, :func:`zgcore.threads.usable_cores`: one per block), or in a Slurm job of
            several tasks (:func:`slurm_tasks`) its tasks; ``train.pipeline_sync``
            not true or false. ``capacity=False`` checks the configuration only, not this host's
            devices and cores (a graph built on one host and run on another: the task checks again).
    """
    import torch.distributed as dist

    if k < 2:
        raise ConfigError(f"train.execution=\"pipeline\" needs local.K >= 2 blocks (got K={k}); use \"per_block\"")
    if not isinstance(t.get("pipeline_sync", True), bool):
        raise ConfigError(f"train.pipeline_sync must be true or false, got {t.get('pipeline_sync')!r}")
    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda") or not dist.is_available():
        raise ConfigError(f"train.execution=\"pipeline\" runs on device=cpu (gloo) or device=cuda (NCCL); "
                          f"device={device} has no torch.distributed backend here: set device=cpu or train.execution=\"per_block\"")
    if not capacity:
        return "nccl" if kind == "cuda" else "gloo"
    tasks = slurm_tasks()
    if tasks > 1:  # the stages will be this job's tasks: Slurm gave each its cores (and GPU)
        if k > tasks:
            raise ConfigError(f"local.K={k} pipeline stages need {k} Slurm tasks, this job has {tasks}: "
                              f"zerograph slurm ... --tasks-per-worker {k}, or lower local.K")
        return "nccl" if kind == "cuda" else "gloo"
    if kind == "cuda":
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            raise ConfigError(f"device={device} with train.execution=\"pipeline\" needs CUDA and NCCL, and this torch "
                              f"has {'no CUDA device' if not torch.cuda.is_available() else 'no NCCL'}: set device=cpu")
        n = torch.cuda.device_count()
        if k > n:
            raise ConfigError(f"local.K={k} pipeline stages need {k} CUDA devices (one per block), this host gives {n}: "
                              f"lower local.K or use train.execution=\"per_block\"")
        return "nccl"
    if not dist.is_gloo_available():
        raise ConfigError("train.execution=\"pipeline\" on CPU needs torch.distributed's gloo backend, which this torch lacks")
    cores = usable_cores() if cores is None else cores
    if k > cores:
        raise ConfigError(f"local.K={k} pipeline stages need {k} CPU cores (one process per block), this process may use "
                          f"{cores}: lower local.K, give the job more cores, or use train.execution=\"per_block\"")
    return "gloo"


def resume_point(work: Path, k: int) -> int:
    """Prepare every stage's folder to restart from the last step all ``k`` stages saved, and return
    that step (0: none). That step's checkpoint becomes each stage's ``checkpoint.pt`` (what
    :class:`zgcore.training.loop.TrainLoop` resumes from); checkpoints of later steps, which not
    every stage reached, and the records of the last attempt are removed."""
    folders = [stage_dir(work, j) for j in range(k)]
    for f in folders:
        f.mkdir(parents=True, exist_ok=True)
        for s in checkpoint_steps(f):  # one whose bytes do not load is no resume point
            if load_checkpoint(f / f"checkpoint-{s:08d}.pt") is None:
                (f / f"checkpoint-{s:08d}.pt").unlink(missing_ok=True)
    common = set.intersection(*(set(checkpoint_steps(f)) for f in folders))
    step = max(common) if common else 0
    for f in folders:
        for name in (RESULT, ERROR, CKPT, FINAL_STATE):
            (f / name).unlink(missing_ok=True)
        for s in checkpoint_steps(f):
            if s > step:
                (f / f"checkpoint-{s:08d}.pt").unlink()
        if step:
            with atomic_path(f / CKPT) as tmp:
                shutil.copyfile(f / f"checkpoint-{step:08d}.pt", tmp)
    return step


def _failure(codes: list[int | None], work: Path, k: int, name: str, bounds: list[int]) -> Exception:
    """The one-line error of a failed pipeline: the stage that failed first in cause (one that raised
    something other than a broken connection, else one killed by a signal other than the SIGTERM
    sent to stop the others, else one that exited non-zero), what happened to it, and from which
    step a rerun resumes. A stage's non-finite loss comes back as :class:`NonFiniteError`. ``codes``:
    each stage's exit code (negative: the signal that ended it; ``None``: unknown, an ``srun`` task)."""
    recs = [read_record(stage_dir(work, j), ERROR) for j in range(k)]
    for r in recs:
        if r and r.get("non_finite"):
            nf = r["non_finite"]
            return NonFiniteError(nf["message"], nf["step"], nf["what"], nf["value"])
    cause, reason = None, ""
    for j, r in enumerate(recs):
        if r and not r["comm"]:
            cause, reason = j, f"raised {r['type']}: {r['message']}"
            break
    if cause is None:
        for j, c in enumerate(codes):
            if c is not None and c < 0 and -c != signal.SIGTERM and not recs[j]:
                cause, reason = j, f"was killed by {signal.Signals(-c).name}"
                break
    if cause is None:  # an srun task that left neither a result nor an error: Slurm or the kernel ended it
        j = next((j for j, c in enumerate(codes) if c is None and not recs[j]
                  and read_record(stage_dir(work, j), RESULT) is None), None)
        if j is not None:
            cause, reason = j, "ended without a result or an error (killed: see the job's log)"
    if cause is None:
        j = next((j for j, c in enumerate(codes) if c not in (0, None, -signal.SIGTERM)), 0)
        cause, reason = j, (f"raised {recs[j]['type']}: {recs[j]['message']}" if recs[j] else f"exited with code {codes[j]}")
    common = set.intersection(*(set(checkpoint_steps(stage_dir(work, j))) for j in range(k)))
    resume = max(common) if common else 0  # where a rerun restarts (resume_point)
    msg = (f"{name}: pipeline stage {cause} (block {cause}, layers {bounds[cause]}-{bounds[cause + 1] - 1}) {reason}; "
           f"every stage was stopped; a rerun resumes from step {resume}")
    return PipelineStageError(msg, cause, reason)


def train_pipeline(lm, train_tokens: np.ndarray, setup: Mapping[str, Any], t: Mapping[str, Any], device: str = "cpu",
                   work: Path | None = None, run_hash: str = "", name: str = "local learning",
                   threads: int | None = None) -> dict[str, Any]:
    """Pretrain ``lm`` (a :class:`~zgcore.local.model.LocalLM` of ``setup``, on the CPU, as
    :func:`~zgcore.local.model.build_local` made it) with one process per block, and load the
    trained blocks back into ``lm``.

    Args:
        train_tokens: ``[n, T]`` int64 model ids. setup: the normalised configuration
            (``model``, ``train``, ``local``). t: its train settings with ``checkpoint_every`` and
            ``log_every``. device: ``cpu`` or ``cuda`` (stage ``j`` on ``cuda:j``).
        work: the work folder (checkpoints per stage, the merged ``loss_log.csv`` and each stage's
            final state as ``train_state_stage<j>.pt``); ``None``: a temporary folder, removed.
        threads: torch threads per stage (default: this process's threads divided among the K
            stages, at least 1; in an ``srun`` task, this process's threads).

    Returns:
        :func:`~zgcore.local.training.train_local`'s metrics (``steps``, ``tokens``,
        ``tokens_sha256``, ``seconds``, ``first_loss``, ``final_loss``, ``memory``,
        ``memory_ratio``, ``resumed_from``; ``seconds`` includes starting the processes) plus
        ``train_seconds`` (from the first stage's loop start to the last one's end) and
        ``tokens_per_second`` (tokens trained in this attempt over it), ``execution``, ``pipeline_sync``, ``stages``
        (each stage's ``seconds``, ``idle_seconds``, ``idle_share``, ``peak_rss_bytes``,
        ``cuda_peak_bytes``), ``staleness_mean`` and ``staleness_max`` per block (steps),
        ``kept`` (the files of ``work`` an output should keep).

    Raises:
        ConfigError: :func:`check_pipeline`, before any process starts. PipelineStageError: a stage
            died or raised (one line naming it). NonFiniteError: a stage's loss or gradient norm.
    """
    k = lm.k
    check_pipeline(k, device, t)
    seq_len = train_tokens.shape[1]
    steps = steps_for(t, seq_len)
    bsz, data_seed = int(t["batch_size"]), int(t["data_seed"])
    sha = hashlib.sha256()
    for step in range(steps):
        sha.update(np.ascontiguousarray(train_tokens[batch_indices(len(train_tokens), bsz, data_seed, step)], dtype=np.int64).tobytes())
    first = torch.as_tensor(train_tokens[batch_indices(len(train_tokens), bsz, data_seed, 0)])
    memory = {m: measure_activation_memory(lm, first, m) for m in ("together", "per_block")}
    scratch = None
    if work is None:
        scratch = work = Path(tempfile.mkdtemp(prefix="zg-pipeline-"))
    work = Path(work)
    resume_point(work, k)  # prepares the stages' folders to restart from the last step all saved
    store = work / f"rendezvous-{uuid.uuid4().hex[:8]}"
    spec = {"setup": dict(setup), "train": dict(t), "tokens": train_tokens, "vocab_size": lm.model.config.vocab_size,
            "k": k, "steps": steps, "device": str(device), "work": str(work), "store": str(store), "run_hash": run_hash,
            "name": name, "parent": os.getpid(),  # an srun task has its own cores; spawned stages share this process's
            "threads": threads or (torch.get_num_threads() if slurm_tasks() > 1 else max(1, torch.get_num_threads() // k))}
    t0 = time.perf_counter()
    try:
        if slurm_tasks() > 1:
            _srun(spec, work, k, name, lm.bounds)
        else:
            _spawn(spec, work, k, name, lm.bounds)
    finally:
        store.unlink(missing_ok=True)
    seconds = time.perf_counter() - t0
    return _assemble(lm, work, k, steps, seq_len, bsz, sha.hexdigest(), seconds, memory, t, scratch)


def _spawn(spec: dict, work: Path, k: int, name: str, bounds: list[int]) -> None:
    """The stages as ``torch.multiprocessing`` (spawn) children of this process; when one fails the
    others are stopped (SIGTERM, then SIGKILL) and :func:`_failure` is raised."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(run_stage, args=(spec,), nprocs=k, join=False, start_method="spawn")
    write_json(work / PIDS, {"pids": [p.pid for p in ctx.processes]})
    try:
        while not ctx.join(grace_period=5.0):
            pass
    except (mp.ProcessExitedException, mp.ProcessRaisedException):
        raise _failure([p.exitcode for p in ctx.processes], work, k, name, bounds) from None
    finally:
        for p in ctx.processes:  # the parent itself failed (interrupted): no stage outlives it
            if p.is_alive():
                p.kill()
                p.join()
        (work / PIDS).unlink(missing_ok=True)


def srun_command(folder: Path, k: int, threads: int) -> list[str]:
    """The ``srun`` that starts ``k`` stages as the tasks of this Slurm job (``--kill-on-bad-exit``:
    one that fails ends the others), each running ``python -m zgcore.local.stage folder``."""
    import sys

    return ["srun", f"--ntasks={k}", "--kill-on-bad-exit=1", f"--cpus-per-task={threads}", sys.executable, "-m",
            "zgcore.local.stage", str(folder)]


def _srun(spec: dict, work: Path, k: int, name: str, bounds: list[int]) -> None:
    """The stages as the tasks of one ``srun`` in this Slurm job (the spec as JSON and the tokens as
    ``.npy`` in ``work/spec``); a failed step raises :func:`_failure`."""
    import subprocess

    folder = work / "spec"
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "spec.json", {**{key: v for key, v in spec.items() if key != "tokens"}, "parent": 0})
    np.save(folder / "tokens.npy", spec["tokens"])
    r = subprocess.run(srun_command(folder, k, int(spec["threads"])))
    if r.returncode != 0:
        raise _failure([0 if read_record(stage_dir(work, j), RESULT) else None for j in range(k)], work, k, name, bounds)


def _assemble(lm, work: Path, k: int, steps: int, seq_len: int, bsz: int, sha: str, seconds: float,
              memory: dict, t: Mapping[str, Any], scratch: Path | None) -> dict[str, Any]:
    """Load every stage's trained block into ``lm``, merge the stages' logs into ``loss_log.csv``
    (``step, ce_b*, mtp_b*, staleness_b*, idle_s_b*, lr``) and move each final state to
    ``train_state_stage<j>.pt``; returns the run's metrics."""
    import csv

    from torch import nn

    logs, stages = [], []
    for j in range(k):
        folder = stage_dir(work, j)
        ck = torch.load(folder / FINAL_STATE, map_location="cpu", weights_only=True)
        nn.ModuleList(lm.block_modules(j)).load_state_dict(ck["modules"]["block"])
        logs.append(np.asarray([r[1:-1] for r in ck["log"]], dtype=np.float64).reshape(len(ck["log"]), 4))
        res = read_record(folder, RESULT) or {}
        res["idle_share"] = res.get("idle_seconds", 0.0) / res["seconds"] if res.get("seconds") else float("nan")
        stages.append(res)
        lrs = [r[-1] for r in ck["log"]]
    rows = [[s + 1, *[logs[j][s, c] for c in range(3) for j in range(k)], *[logs[j][s, 3] for j in range(k)], lrs[s]]
            for s in range(steps)]
    cols = ([f"ce_b{j + 1}" for j in range(k)] + [f"mtp_b{j + 1}" for j in range(k)]
            + [f"staleness_b{j + 1}" for j in range(k)] + [f"idle_s_b{j + 1}" for j in range(k)])
    kept = [LOSS_LOG]
    with atomic_path(work / LOSS_LOG) as tmp, open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *cols, "lr"])
        w.writerows(rows)
    for j in range(k):
        os.replace(stage_dir(work, j) / FINAL_STATE, work / f"train_state_stage{j}.pt")
        kept.append(f"train_state_stage{j}.pt")
    resume_from = min(s.get("resumed_from", 0) for s in stages)
    span = max(s["ended"] for s in stages) - min(s["started"] for s in stages)  # the stages' loops, start-up excluded
    ce = np.stack([lg[:, 0] for lg in logs], 1)
    tail = ce[-max(1, steps // 10):]
    stale = np.stack([lg[:, 2] for lg in logs], 1)
    sp = {m: memory[m]["saved_peak_bytes"] for m in memory}
    out = {"steps": steps, "tokens": steps * bsz * seq_len, "tokens_sha256": sha, "seconds": seconds,
           "first_loss": ce[0].tolist(), "final_loss": tail.mean(0).tolist(), "memory": memory,
           "memory_ratio": sp["together"] / sp["per_block"] if sp["per_block"] else float("nan"),
           "resumed_from": resume_from, "execution": "pipeline",
           "pipeline_sync": bool(t.get("pipeline_sync", True)), "stages": stages,
           "staleness_mean": stale.mean(0).tolist(), "staleness_max": stale.max(0).tolist(),
           "train_seconds": span, "tokens_per_second": (steps - resume_from) * bsz * seq_len / span if span else math.nan, "kept": kept}
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
        out["kept"] = []
    return out
