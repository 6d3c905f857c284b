"""One stage of the pipelined execution of local learning: the process that owns block ``j``.

Started by :func:`zgcore.local.pipeline.train_pipeline` (one process per block, ``torch.multiprocessing``
spawn, rendezvous through a ``torch.distributed.FileStore``). Stage ``j`` builds the model exactly as
the one-process run does (same seed, so its block's initial weights are the same bits), frees the
parameters of every block it does not own, and trains its block, aux head(s) and AdamW on the one
training loop (:class:`zgcore.training.loop.TrainLoop`: schedule, clipping, non-finite checks,
loss log, checkpoints) with its own RNG stream (``block_seed(train.seed, 2000 + j)``; nothing in a
step draws from it today).

Messages travel forward only: for every step, stage ``j`` sends the *detached* output
``[B, T, d]`` of its block and the index of the batch it came from (an int64 pair: batch,
0) to stage ``j + 1`` with ``torch.distributed`` point-to-point calls (``isend``/``irecv``: gloo
on CPU, NCCL on CUDA). No gradient and no message ever travels backwards.

* sync (``train.pipeline_sync = true``): stage ``j`` at step ``s`` waits for stage ``j - 1``'s
  output of step ``s``, so every block consumes exactly the activations of the one-process
  ``per_block`` run: the weights are the same bits.
* async (``false``): stage ``j`` at step ``s`` takes the newest output stage ``j - 1`` has
  delivered that is not of a later step, and waits only while the newest is older than step
  ``s - 1``. It may thus train on what block ``j - 1`` produced one step earlier (block
  ``j - 1`` already stepping on the next batch), or train twice on one message. Its
  *staleness* ``s - b`` (``b``: the batch its input came from) is at most ``j``; it is recorded
  for every step (``staleness_b<j+1>`` in the loss log).
"""
from __future__ import annotations

import collections
import json
import os
import resource
import threading
import time
import traceback
from pathlib import Path
from typing import Any
from collections.abc import Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from zgcore.atomic import write_json
from zgcore.device import to_device
from zgcore.training.blocks import block_seed
from zgcore.training.loop import CKPT, NonFiniteError, TrainLoop
from .model import build_local
from .training import _checked, batch_indices

SEND_DEPTH = 2  # outputs a stage may have in flight to the next one before it waits (bounds memory)
RESULT, ERROR = "result.json", "error.json"  # what a stage leaves in its folder when it ends
HOLD_ENV = "ZG_PIPELINE_HOLD"  # tests only: "<stage>:<step>" holds that stage after that step (to kill it there)


def stage_dir(work: Path, j: int) -> Path:
    """Stage ``j``'s folder in the pipeline's work folder: its checkpoints, final state, result."""
    return Path(work) / f"stage{j}"


def checkpoint_steps(folder: Path) -> list[int]:
    """Steps of the checkpoints (``checkpoint-<step>.pt``) a stage kept in ``folder``, ascending."""
    out = []
    for p in folder.glob("checkpoint-*.pt"):
        try:
            out.append(int(p.stem.split("-", 1)[1]))
        except ValueError:
            continue
    return sorted(out)


class StageLoop(TrainLoop):
    """:class:`TrainLoop` of one stage: each checkpoint is kept under its step
    (``checkpoint-<step>.pt``) until every stage has saved a later one, so that a resume can restart
    all stages from the last step all of them saved (:func:`zgcore.local.pipeline.resume_point`)."""

    def __init__(self, *args, stages: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.stages = int(stages)

    def save(self, path: Path) -> None:
        """Save a checkpoint as ``checkpoint-<step>.pt`` (then drop this stage's checkpoints older than
        the last step every stage has saved); any other state (the final one) where asked."""
        if path.name != CKPT:
            return super().save(path)
        step = int(self.log[-1][0])
        super().save(path.with_name(f"checkpoint-{step:08d}.pt"))
        common = min(max(checkpoint_steps(stage_dir(path.parent.parent, i)) or [0]) for i in range(self.stages))
        for s in checkpoint_steps(path.parent):
            if s < common:
                (path.parent / f"checkpoint-{s:08d}.pt").unlink(missing_ok=True)


class Inbox:
    """What stage ``j`` receives from stage ``j - 1``: one ``irecv`` of the next step's message is
    always posted (``[2]`` int64 batch index and ``[B, T, d]`` output, on the stage's device)."""

    def __init__(self, src: int, shape: tuple[int, ...], device: torch.device, start: int, steps: int, sync: bool):
        self.src, self.shape, self.device, self.steps, self.sync = src, shape, device, steps, sync
        self.next, self.latest_step, self.latest = start, -1, None
        self._post()

    def _post(self) -> None:
        self.works = []
        if self.next < self.steps:
            self.meta = torch.empty(2, dtype=torch.int64, device=self.device)
            self.h = torch.empty(self.shape, dtype=torch.float32, device=self.device)
            self.works = [dist.irecv(self.meta, self.src, tag=1), dist.irecv(self.h, self.src, tag=2)]

    def _receive(self) -> None:
        """Wait for the posted message, make it the latest, post the next."""
        for w in self.works:
            w.wait()
        self.latest, self.latest_step = (self.h, self.meta), self.next
        self.next += 1
        self._post()

    def _arrived(self) -> bool:
        return bool(self.works) and all(w.is_completed() for w in self.works)

    def take(self, step: int) -> tuple[torch.Tensor, int, float]:
        """The input of ``step``: ``(h [B, T, d], batch index, seconds waited)``; see the module
        docstring for which message each schedule takes."""
        need = step if self.sync else step - 1
        t0 = time.perf_counter()
        while self.next <= step and (self.latest is None or self.latest_step < need or (not self.sync and self._arrived())):
            self._receive()
        h, meta = self.latest  # sync: the batch is the step's own, and is not read back from the device
        return h, step if self.sync else int(meta[0]), time.perf_counter() - t0

    def drain(self) -> None:
        """Receive (and drop) every message still to come: an asynchronous stage may end its last step
        before its upstream has sent its last output, and a stage that left the group then would
        close the connection under that send ("Connection closed by peer" in the upstream stage)."""
        while self.works:
            self._receive()


class Outbox:
    """What stage ``j`` sends to stage ``j + 1``: ``isend`` of each step's batch index and detached
    output, at most :data:`SEND_DEPTH` in flight (then it waits for the oldest)."""

    def __init__(self, dst: int):
        self.dst, self.pending = dst, collections.deque()

    def put(self, h: torch.Tensor, batch: int) -> float:
        """Send ``h`` (detached) of batch ``batch``; returns the seconds spent waiting."""
        meta = torch.tensor([batch, 0], dtype=torch.int64, device=h.device)
        h = h.detach().contiguous()
        self.pending.append(([dist.isend(meta, self.dst, tag=1), dist.isend(h, self.dst, tag=2)], meta, h))
        t0 = time.perf_counter()
        while len(self.pending) > SEND_DEPTH:
            for w in self.pending.popleft()[0]:
                w.wait()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Wait until every message was delivered."""
        while self.pending:
            for w in self.pending.popleft()[0]:
                w.wait()


def own_block(lm, j: int) -> nn.ModuleList:
    """Free (empty) every parameter of ``lm`` that block ``j`` does not own; return its modules."""
    mods = nn.ModuleList(lm.block_modules(j))
    mine = {id(p) for p in mods.parameters()}
    for p in lm.parameters():
        if id(p) not in mine:
            p.data = p.data.new_empty(0)
    return mods


def peak_rss(reset: bool = False) -> int:
    """This process's peak resident memory in bytes (Linux: ``VmHWM`` of ``/proc/self/status``, else
    ``ru_maxrss``); ``reset=True`` first lowers the peak to what is resident now (Linux
    ``/proc/self/clear_refs``), so that memory freed before counts no more."""
    try:
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _watch_parent(parent: int) -> None:
    """End this process when the process that started it is gone (no stage outlives its task)."""
    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)
    threading.Thread(target=watch, daemon=True, name="watch-parent").start()


def stage_device(device: str, j: int) -> torch.device:
    """Stage ``j``'s device: on CUDA one GPU per block, ``cuda:j`` of the GPUs this process sees
    (``cuda:0`` in an ``srun`` task given one GPU), else the CPU."""
    if not str(device).startswith("cuda"):
        return torch.device("cpu")
    return torch.device("cuda", j % max(1, torch.cuda.device_count()))


def run_stage(j: int, spec: Mapping[str, Any]) -> None:
    """Entry point of stage process ``j`` (``torch.multiprocessing`` calls it with its index):
    join the process group, train block ``j`` (:func:`train_stage`), write ``result.json`` into
    its folder, or ``error.json`` (type, message, whether it is a communication error) and raise."""
    if spec["parent"]:  # started by torch.multiprocessing (an srun task is ended by Slurm instead)
        _watch_parent(int(spec["parent"]))
    torch.set_num_threads(int(spec["threads"]))
    folder = stage_dir(Path(spec["work"]), j)
    dev = stage_device(spec["device"], j)
    try:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        store = dist.FileStore(str(spec["store"]), int(spec["k"]))
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, rank=j, world_size=int(spec["k"]))
        result = train_stage(j, spec, dev)
        write_json(folder / RESULT, result)
    except BaseException as e:
        rec = {"type": type(e).__name__, "message": str(e).strip().splitlines()[0][:500] if str(e).strip() else "",
               "comm": isinstance(e, dist.DistError) or "onnection" in str(e) or "peer" in str(e),
               "traceback": traceback.format_exc()[-4000:]}
        if isinstance(e, NonFiniteError):
            rec["non_finite"] = {"message": str(e), "step": e.step, "what": e.what, "value": e.value}
        write_json(folder / ERROR, rec)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train_stage(j: int, spec: Mapping[str, Any], dev: torch.device) -> dict[str, Any]:
    """Train block ``j`` for the run's steps (from its checkpoint, if the launcher left one as
    ``checkpoint.pt``); returns its measurements: ``seconds``, ``idle_seconds`` (waiting for input
    or for the next stage to take output), ``peak_rss_bytes`` (the process's peak resident memory
    while it trains, :func:`peak_rss`; the whole model it builds first and frees is not counted),
    ``cuda_peak_bytes`` (``None`` off CUDA), ``resumed_from``, ``median_step_seconds`` (between
    the ends of consecutive steps: the steady pace, warm-up excluded), ``started``/``ended`` (wall clock of
    its loop, s since the epoch; every stage starts after a barrier)."""
    setup, t, k = spec["setup"], spec["train"], int(spec["k"])
    tokens: np.ndarray = spec["tokens"]
    seq_len, bsz, data_seed = tokens.shape[1], int(t["batch_size"]), int(t["data_seed"])
    steps = int(spec["steps"])
    lm = build_local(setup, int(spec["vocab_size"]), seq_len, "cpu")
    mods = own_block(lm, j)
    lm.to(dev)
    torch.manual_seed(block_seed(int(setup["train"]["seed"]), 2000 + j))  # this stage's RNG stream
    folder = stage_dir(Path(spec["work"]), j)
    cols = [f"ce_b{j + 1}", f"mtp_b{j + 1}", f"staleness_b{j + 1}", f"idle_s_b{j + 1}"]
    loop = StageLoop(f"{spec['name']} stage {j}", [lm.block_params(j)], t, steps, folder, spec["run_hash"],
                     {"block": mods}, cols, stages=k)
    sync = bool(t.get("pipeline_sync", True))
    inbox = outbox = None
    hold = os.environ.get(HOLD_ENV, "")
    hold_stage, hold_step = (int(x) for x in hold.split(":")) if hold else (-1, -1)
    d = int(setup["model"]["hidden_size"])
    ids_of = lambda b: torch.as_tensor(np.ascontiguousarray(tokens[batch_indices(len(tokens), bsz, data_seed, b)],
                                                            dtype=np.int64))

    def batches(start: int):
        nonlocal inbox, outbox
        if j > 0:
            inbox = Inbox(j - 1, (bsz, seq_len, d), dev, start, steps, sync)
        if j < k - 1:
            outbox = Outbox(j + 1)
        for step in range(start, steps):
            yield ids_of(step)

    def one_step(ids: torch.Tensor, step: int) -> list:
        if j == hold_stage and step == hold_step:
            time.sleep(3600)
        b, waited = step, 0.0
        if inbox is not None:
            x, b, waited = inbox.take(step)
            ids = ids if b == step else ids_of(b)
        ids = to_device(ids, dev)
        x = ids if inbox is None else x
        ctx = lm.context(ids)
        h = lm.run_block(j, x, ctx)
        if outbox is not None:
            waited += outbox.put(h, b)
        loss, info = lm.block_loss(j, h, ids, ctx)
        _checked(loop, step, j, info)
        loop.zero_grad(0)
        loss.backward()
        loop.update(0, step)
        ends.append(time.perf_counter())
        return [info["ce"], info.get("mtp", float("nan")), float(step - b), waited]

    peak_rss(reset=True)  # the model was built whole (for its initial bits): count from here on
    ends: list[float] = []  # when each step's work was queued (s; the device may still be computing on CUDA)
    lm.train()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    dist.barrier()  # every stage built and ready: the loops start together (idle time is the pipeline's own)
    started = time.time()
    m = loop.run(batches, one_step)
    if inbox is not None:
        inbox.drain()
    if outbox is not None:
        outbox.close()
    dist.barrier()  # no stage leaves the group while another still sends or receives
    log = np.asarray([r[1:-1] for r in loop.log], dtype=np.float64).reshape(len(loop.log), len(cols))
    return {"stage": j, "seconds": m["seconds"], "idle_seconds": float(log[m["resumed_from"]:, 3].sum()) if len(log) else 0.0,
            "peak_rss_bytes": peak_rss(),
            "cuda_peak_bytes": int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None,
            "resumed_from": m["resumed_from"], "threads": torch.get_num_threads(), "started": started, "ended": time.time(),
            "median_step_seconds": float(np.median(np.diff(ends))) if len(ends) > 1 else float("nan")}


def _smoke(folder: Path, settings: Mapping[str, Any]) -> dict[str, Any]:
    """A training path's seconds-long run (:mod:`zgcore.training.paths`): the pipeline of
    :func:`zgcore.local.training.smoke_setup`'s K = 2 model, its last stage (the one that receives
    its input from another process) trained in this process and on this thread, so that the
    contracts' shims see its loop, the upstream stage spawned as the pipeline spawns it. Checkpoints
    land in ``folder / "work" / "stage1"``; returns the stage's measurements."""
    import torch.multiprocessing as mp

    from .config import steps_for
    from .training import smoke_setup

    lm, tokens, run, t = smoke_setup(settings, "pipeline")
    work = folder / "work"
    work.mkdir(parents=True, exist_ok=True)
    spec = {"setup": run, "train": dict(t), "tokens": tokens, "vocab_size": lm.model.config.vocab_size, "k": 2,
            "steps": steps_for(t, tokens.shape[1]), "device": "cpu", "work": str(work),
            "store": str(work / "rendezvous"), "run_hash": "smoke", "name": "local pipeline smoke",
            "parent": os.getpid(), "threads": 1}
    upstream = mp.start_processes(run_stage, args=(spec,), nprocs=1, join=False, start_method="spawn")  # stage 0
    ended = False
    try:
        dist.init_process_group("gloo", store=dist.FileStore(spec["store"], 2), rank=1, world_size=2)
        result = train_stage(1, spec, torch.device("cpu"))
        ended = True
        return result
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for p in upstream.processes:  # after a failure here (the NaN contract) stage 0 waits for this one: end it
            p.join(timeout=60 if ended else 0)
            if p.is_alive():
                p.kill()
                p.join()


def _register() -> None:
    from zgcore.training.paths import register_path

    register_path("local/pipeline", __name__, _smoke)


if __name__ != "__main__":  # run as a stage's process (python -m) the package's import has registered it
    _register()


def read_record(folder: Path, name: str) -> dict[str, Any] | None:
    """A stage's ``result.json`` or ``error.json`` in ``folder``, or ``None`` when it wrote none."""
    try:
        return json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return None


def main(argv: list[str]) -> None:
    """``python -m zgcore.local.stage FOLDER``: one stage as a task of ``srun``, its index the task's
    rank (``SLURM_PROCID``); ``FOLDER`` holds ``spec.json`` and ``tokens.npy``
    (:func:`zgcore.local.pipeline.train_pipeline` writes them; nothing is unpickled)."""
    folder = Path(argv[0])
    spec = json.loads((folder / "spec.json").read_text())
    spec["tokens"] = np.load(folder / "tokens.npy")
    run_stage(int(os.environ["SLURM_PROCID"]), spec)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
