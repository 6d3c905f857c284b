"""Watching a run live: :class:`TensorBoardWatch`, a :class:`~zgcore.training.loop.TrainLoop`
callback that writes every step's values, learning rate, gradient norms and throughput as
TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``), one run folder per task, so
``tensorboard --logdir <outputs>/tensorboard`` shows every block's curve side by side while a
run is in progress.

The event files are an observation of the run, never one of its results: they live outside the
task's atomic output folder, no hash covers whether they are written, and nothing reads them back.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from zgcore.training.loop import StepInfo

FLUSH_SECONDS = 5.0  # the writer's background thread flushes events to disk at least this often (s)
TENSORBOARD_DIR = "tensorboard"  # under the outputs root: <outputs>/tensorboard/<family>/<label>-<hash>


class TensorBoardWatch:
    """Write a training run's per-step scalars to TensorBoard event files in ``log_dir``.

    Tags (x axis: the step, 1-based): ``loss/<column>`` for each of the loop's columns (nats/token
    or the objective's unit; NaN values are skipped), ``lr``, ``grad_norm`` (one group) or
    ``grad_norm/group<j>`` (several, before clipping), ``throughput/tokens_per_s`` (token
    positions of the step's batch over the step's wall time, waiting for data included) and
    ``throughput/data_wait_fraction`` (share of the step's wall time spent waiting for its batch)
    and, given ``flops_per_token`` and ``peak``, ``throughput/mfu`` (the step's achieved FLOP/s over
    ``peak``; :mod:`zgcore.training.mfu`).

    Args:
        log_dir: the run's folder (created at the first step).
        flops_per_token: training FLOPs per token position of the step's batch
            (:mod:`zgcore.evaluation.flops` counts them), or None (no MFU curve).
        peak: the peak FLOP/s of this process (:func:`zgcore.training.mfu.probe`), or None.

    The writer opens at the first step (a run that fails before training writes nothing) and
    closes in :meth:`close`. A resumed run opens it with ``purge_step`` at its first step, so
    TensorBoard drops the events written after the last checkpoint (every earlier event was
    flushed before that checkpoint, :meth:`flush`) and the run shows one curve.
    """

    def __init__(self, log_dir: str | os.PathLike, flops_per_token: float | None = None, peak: float | None = None):
        self.log_dir = Path(log_dir)
        self.flops_per_token, self.peak = flops_per_token, peak
        self._writer = None
        self._off = False

    def __call__(self, info: StepInfo) -> None:
        """Write one step's scalars (see the class). Without the ``tensorboard`` package (a machine
        set up without it) this prints one line and writes nothing: the view is lost, not the run."""
        if self._off:
            return
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter  # tensorboard is imported only when used
            except ImportError as e:
                self._off = True
                print(f"no TensorBoard view of this run ({e}): pip install tensorboard, or set the section's "
                      "tensorboard = false to silence this", flush=True)
                return
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(str(self.log_dir), purge_step=info.step if info.step > 1 else None,
                                         flush_secs=FLUSH_SECONDS)
        w, s = self._writer, info.step
        for k, v in info.values.items():
            if math.isfinite(v):
                w.add_scalar(f"loss/{k}", v, s)
        w.add_scalar("lr", info.lr, s)
        for j, g in enumerate(info.grad_norms):
            w.add_scalar("grad_norm" if len(info.grad_norms) == 1 else f"grad_norm/group{j}", g, s)
        if info.seconds > 0:
            w.add_scalar("throughput/tokens_per_s", info.tokens / info.seconds, s)
            w.add_scalar("throughput/data_wait_fraction", info.data_seconds / info.seconds, s)
            if self.flops_per_token and self.peak:
                w.add_scalar("throughput/mfu", info.tokens * self.flops_per_token / info.seconds / self.peak, s)

    def flush(self) -> None:
        """Write every event recorded so far to disk (the loop calls it before each checkpoint)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (nothing if no step was written)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def tensorboard_dir(outputs: str | os.PathLike, family: str, run: str) -> Path:
    """The event folder of one task: ``<outputs>/tensorboard/<family>/<run>`` (``run``: the task's
    ``<label>-<hash>``, as its output folder is named)."""
    return Path(outputs) / TENSORBOARD_DIR / family / run
