"""The one training loop: every training stage (ZeroGraph blocks, local-learning pretraining, healing
and end-to-end distillation) runs here.

It owns what all of them share: one AdamW per parameter group (a ZeroGraph block is one group; a
local-learning model has one per gradient-isolated block), the learning-rate schedule (linear
warmup, then cosine to 10%), gradient clipping, the check that every loss and gradient norm is
finite, the loss log (``loss_log.csv``), atomic checkpoints every ``checkpoint_every`` steps and
a bitwise-identical resume from them, and the final optimizer and RNG state (``train_state.pt``).
What a step computes (forward, losses, backward order) is the caller's ``step_fn``; it calls
:meth:`TrainLoop.check` on each loss and :meth:`TrainLoop.update` to clip and step a group.

Losses and gradient norms stay on the device and are read back every ``log_every`` steps, before
each checkpoint and at the end (one host-device sync each, so the host queues the next step while
the device computes; a non-finite one fails the run there, before anything of its state is
written). At each read-back the loop hands a :class:`StepInfo` (values, lr, gradient norms,
tokens/s) per step to its callbacks (e.g. :class:`zgcore.training.watch.TensorBoardWatch`, a live
view of every training task).

Checkpoints hold only tensors and plain Python values and load with
``torch.load(weights_only=True)``: nothing is unpickled from a shared folder.
"""
from __future__ import annotations

import csv
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from zgcore.atomic import atomic_path
from zgcore.progress import progress_bar
from zgcore.training.checkpoint import CKPT_FORMAT, load_checkpoint, state_digest  # noqa: F401 (re-exported)

CKPT = "checkpoint.pt"
FINAL_STATE = "train_state.pt"  # the last step's weights, optimizer and RNG state (same layout as a checkpoint)
LOSS_LOG = "loss_log.csv"
# steps between read-backs of the losses and gradient norms kept on the device (``<section>.log_every``)
LOG_EVERY = 10


class NonFiniteError(RuntimeError):
    """A loss or gradient norm became NaN or infinite during training: the run stops at once,
    nothing is saved as a result, and the last checkpoint taken before the fault is kept.

    Attributes (``None`` when not given): ``step`` (1-based), ``what`` (e.g. ``"the loss"``),
    ``value`` (the non-finite value) — what a learning-rate search records of a diverged candidate."""

    def __init__(self, message: str, step: int | None = None, what: str | None = None, value: float | None = None):
        super().__init__(message)
        self.step, self.what, self.value = step, what, value

    def __reduce__(self):  # picklable with its attributes (worker processes)
        return type(self), (str(self), self.step, self.what, self.value)

    def record(self) -> dict:
        """``{"step", "what", "value" (as text: JSON has no NaN), "message"}``."""
        return {"step": self.step, "what": self.what, "value": str(self.value), "message": str(self)}


def lr_at(step: int, total: int, lr: float, warmup: int) -> float:
    """Learning rate at ``step``: linear warmup over ``warmup`` steps, then cosine to 10% of ``lr``."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass
class StepInfo:
    """What a callback of :class:`TrainLoop` sees after each step.

    Attributes:
        step: the step just done, 1-based. steps: the run's total.
        values: the step's values by column name (``loss`` first; may hold NaN where a column has none).
        lr: the learning rate of the step. grad_norms: each group's gradient norm before clipping
            (empty if ``step_fn`` did not call :meth:`TrainLoop.update`).
        tokens: token positions in the step's batch (:func:`batch_tokens`).
        seconds: wall time of the step, waiting for its batch included (s). data_seconds: of which
            waiting for the batch (s).
    """
    step: int
    steps: int
    values: dict[str, float]
    lr: float
    grad_norms: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    data_seconds: float = 0.0


def batch_tokens(batch: Any) -> int:
    """Token positions in a batch: ``B * T`` of a tensor ``[B, T, ...]`` (token ids or boundary
    states), or of the first item of a tuple or list of them; 0 for anything else."""
    t = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    return int(t.shape[0] * t.shape[1]) if isinstance(t, torch.Tensor) and t.dim() >= 2 else 0


class TrainLoop:
    """One training run: optimizers, schedule, clipping, finiteness checks, log, checkpoints.

    Args:
        name: who is training, used in messages (e.g. ``"TrainBlock block0-clean-cached-s0"``).
        groups: parameter groups; group ``j`` gets its own AdamW and its own clipping.
        t: train settings: ``lr``, ``weight_decay``, ``grad_clip`` (0 = no clipping),
            ``warmup_steps``, ``checkpoint_every`` (optional; 0 or absent = no checkpoints),
            ``log_every`` (optional, default :data:`LOG_EVERY`: steps between read-backs of the
            values kept on the device, see :meth:`run`).
        steps: total optimizer steps.
        work: folder for checkpoints, ``loss_log.csv`` and ``train_state.pt`` (kept across
            interruptions); ``None`` = keep nothing on disk.
        run_hash: a checkpoint written under another hash is never resumed from.
        modules: the modules whose ``state_dict`` a checkpoint holds, by name.
        columns: names of the values ``step_fn`` returns each step (the log's columns).
        section: the configuration section that holds ``t`` (``"train"``, ``"heal"``, ``"distill"``),
            named in the advice of a non-finite error (``heal.lr``, ...).
        callbacks: called after every step with a :class:`StepInfo` (``callback(info)``); flushed
            (their ``flush()``, if any) before each checkpoint is written, so a run resumed from a
            checkpoint finds their record complete up to it; closed (``close()``, if any) when
            :meth:`run` ends, however it ends. They observe only:
            nothing they do changes the run's bytes.
    """

    def __init__(self, name: str, groups: Sequence[Sequence[torch.nn.Parameter]], t: Mapping[str, Any], steps: int,
                 work: Path | None, run_hash: str, modules: Mapping[str, torch.nn.Module], columns: Sequence[str],
                 section: str = "train", callbacks: Sequence[Callable[[StepInfo], None]] = ()):
        self.name, self.steps, self.work, self.run_hash, self.section = name, int(steps), work, run_hash, section
        self.groups = [list(g) for g in groups]
        self.modules, self.columns = dict(modules), list(columns)
        self.lr, self.warmup, self.clip = float(t["lr"]), int(t["warmup_steps"]), float(t["grad_clip"])
        self.every = int(t.get("checkpoint_every") or 0)
        self.optimizers = [torch.optim.AdamW(g, lr=self.lr, weight_decay=float(t["weight_decay"])) for g in self.groups]
        self.log: list[list[float]] = []
        self.callbacks = list(callbacks)
        self._norms: dict[int, torch.Tensor] = {}  # this step's gradient norm per group (for the callbacks)
        self._checks: list[tuple[int, str, float | torch.Tensor]] = []  # this step's values to check at the read-back
        self.log_every = max(1, int(t.get("log_every") or LOG_EVERY))

    # -- what a step function calls
    def check(self, step: int, what: str, value: float | torch.Tensor) -> float | torch.Tensor:
        """Return ``value`` (a float, or a 0-dim loss or norm tensor on any device) at once and
        check it at the next read-back (every ``log_every`` steps, before each checkpoint and at
        the end), in the order the checks were made, so no step waits for the device: a
        non-finite value raises :class:`NonFiniteError` there, naming the run, the step (1-based)
        where it appeared, what and the value, and what to change."""
        self._checks.append((step, what, value.detach() if isinstance(value, torch.Tensor) else value))
        return value

    def _non_finite(self, step: int, what: str, value: float) -> NonFiniteError:
        kept = f"the last checkpoint is kept in {self.work}" if self.work and (self.work / CKPT).exists() else "no checkpoint was taken yet"
        return NonFiniteError(
            f"{self.name}: {what} is {value} at step {step + 1} of {self.steps}; training stopped and nothing was saved "
            f"as done ({kept}). Lower {self.section}.lr (now {self.lr:g}), set {self.section}.grad_clip > 0 (now "
            f"{self.clip:g}; e.g. 1.0), "
            f"or check the input data (a non-finite boundary or token)", step=step + 1, what=what, value=value)

    def zero_grad(self, j: int | None = None) -> None:
        """Clear the gradients of group ``j`` (all groups if ``None``)."""
        for o in self.optimizers if j is None else [self.optimizers[j]]:
            o.zero_grad(set_to_none=True)

    def update(self, j: int, step: int) -> torch.Tensor:
        """Clip group ``j``'s gradients to ``grad_clip`` (if > 0) and step its optimizer; the same
        arithmetic as ``clip_grad_norm_``. Returns the norm before clipping, a 0-dim tensor on the
        parameters' device, checked finite at the next read-back (:meth:`check`): no host sync."""
        params = self.groups[j]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        self.check(step, f"the gradient norm{f' of block {j}' if len(self.groups) > 1 else ''}", norm)
        if self.clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.clip, norm)
        self.optimizers[j].step()
        self._norms[j] = norm
        return norm

    def step_on(self, step: int, loss: torch.Tensor, values: Sequence[float | torch.Tensor] = ()) -> list:
        """One optimizer step of a one-group run on ``loss``: backpropagate, clip and step; the loss
        is checked finite at the next read-back (:meth:`check`). Returns the step's log row
        ``[loss, *values]`` (0-dim tensors or floats)."""
        self.check(step, "the loss", loss)
        self.zero_grad()
        loss.backward()
        self.update(0, step)
        return [loss.detach(), *values]

    def _read_back(self, pending: list[_Pending], bar, progress) -> None:
        """Copy every value, check and gradient norm of the ``pending`` steps to the host in one
        transfer (one host-device sync), raise :class:`NonFiniteError` at the first non-finite
        check (in step order, as an immediate check would have), then log the steps and hand
        them to ``progress`` and the callbacks, in order."""
        if not pending:
            return
        got = iter(_to_host([x for p in pending for x in (*[v for _, _, v in p.checks], *p.values, *p.norms)]))
        # the same fields in the same order, now floats (keyword arguments are evaluated left to right)
        done = [replace(p, checks=[(s, w, next(got)) for s, w, _ in p.checks], values=[next(got) for _ in p.values],
                        norms=[next(got) for _ in p.norms]) for p in pending]
        for p in done:
            for step, what, v in p.checks:
                if not math.isfinite(v):
                    pending.clear()
                    raise self._non_finite(step, what, v)
            self.log.append([p.step + 1, *p.values, p.lr])
            bar.update(1)
            bar.set_postfix(loss=f"{p.values[0]:.4f}")
            if progress:
                progress(p.step + 1, self.steps, p.values)
            if self.callbacks:
                info = StepInfo(p.step + 1, self.steps, dict(zip(self.columns, p.values)), p.lr, p.norms, p.tokens,
                                p.seconds, p.data_seconds)
                for cb in self.callbacks:
                    cb(info)
        pending.clear()

    # -- the loop
    def run(self, batches: Callable[[int], Iterable[Any]], step_fn: Callable[[Any, int], Sequence[float | torch.Tensor]],
            progress: Callable[[int, int, Sequence[float]], None] | None = None) -> dict[str, Any]:
        """Train from the last checkpoint (or step 0) to ``steps``.

        Each step's values, checks and gradient norms stay where ``step_fn`` computed them (on the
        device) and are read back together every ``log_every`` steps (the settings' key, default
        :data:`LOG_EVERY`), before each checkpoint and at the end: one host-device sync per
        read-back instead of one per value, so the host queues step ``k + 1`` (and its batch's
        ``non_blocking`` copy) while the device computes step ``k``. A non-finite value raises
        :class:`NonFiniteError` at its read-back, naming the step where it first appeared, before
        any checkpoint or result of the state after it is written (the parameters in memory may by
        then hold it; the last checkpoint on disk does not).

        Args:
            batches: ``batches(start)`` yields the batches of steps ``start, start+1, ...``.
            step_fn: ``step_fn(batch, step)`` does one step (0-based) and returns the values
                named by ``columns`` (0-dim tensors or floats). The learning rate is already set.
            progress: called as ``progress(step, steps, values)`` for every step (1-based), at its read-back.

        Returns:
            ``steps``, ``first`` and ``final`` (per column: the first step's value and the mean of
            the last 10% of steps), ``seconds`` (wall, s), ``data_seconds`` (time in ``batches``),
            ``compute_seconds`` (time in ``step_fn``, launching work on an accelerator),
            ``resumed_from`` (step).

        Raises:
            NonFiniteError: a non-finite checked value. OSError: a checkpoint that cannot be read for an I/O reason.
        """
        start = self._resume()
        if self.work and not start:  # a resumed run has said so; either way the log shows which worker took the run
            print(f"{self.name}: training {self.steps} steps", flush=True)
        t0 = time.perf_counter()
        data_s = compute_s = 0.0
        it: Iterator[Any] = iter(batches(start))
        bar = progress_bar(self.steps, self.name, "step", initial=start)
        pending: list[_Pending] = []
        try:
            for step in range(start, self.steps):
                t1 = time.perf_counter()
                batch = next(it)
                t2 = time.perf_counter()
                lr = lr_at(step, self.steps, self.lr, self.warmup)
                self._norms.clear()
                self._checks = []
                for o in self.optimizers:
                    for g in o.param_groups:
                        g["lr"] = lr
                values = list(step_fn(batch, step))
                compute_s += time.perf_counter() - t2
                data_s += t2 - t1
                pending.append(_Pending(step, lr, values, self._checks, [self._norms[j] for j in sorted(self._norms)],
                                        batch_tokens(batch), time.perf_counter() - t1, t2 - t1))
                ckpt = self.work and self.every and (step + 1) % self.every == 0 and step + 1 < self.steps
                if ckpt or (step + 1) % self.log_every == 0 or step + 1 == self.steps:
                    self._read_back(pending, bar, progress)
                if ckpt:
                    for cb in self.callbacks:  # what they recorded up to here is on disk before the checkpoint is
                        getattr(cb, "flush", lambda: None)()
                    self.save(self.work / CKPT)
        finally:
            bar.close()
            getattr(it, "close", lambda: None)()
            for cb in self.callbacks:
                getattr(cb, "close", lambda: None)()
        if self.work:
            self.save(self.work / FINAL_STATE)
            with atomic_path(self.work / LOSS_LOG) as tmp, open(tmp, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["step", *self.columns, "lr"])
                w.writerows(self.log)
        vals = np.asarray([r[1:-1] for r in self.log], dtype=np.float64).reshape(len(self.log), len(self.columns))
        tail = vals[-max(1, len(vals) // 10):]
        return {"steps": self.steps, "first": vals[0].tolist() if len(vals) else None,
                "final": tail.mean(0).tolist() if len(vals) else None, "seconds": time.perf_counter() - t0,
                "data_seconds": data_s, "compute_seconds": compute_s, "resumed_from": start}

    def _resume(self) -> int:
        if not self.work:
            return 0
        self.work.mkdir(parents=True, exist_ok=True)
        path = self.work / CKPT
        ck = load_checkpoint(path)
        if ck is None:
            return 0
        if ck["run_hash"] != self.run_hash or set(ck["modules"]) != set(self.modules) or len(ck["optimizers"]) != len(self.optimizers):
            print(f"{self.name}: ignoring {path}, written by another configuration", flush=True)
            return 0
        for k, m in self.modules.items():
            m.load_state_dict(ck["modules"][k])
        for o, sd in zip(self.optimizers, ck["optimizers"]):
            o.load_state_dict(sd)
        torch.set_rng_state(ck["torch_rng"])
        self.log = [list(r) for r in ck["log"]]
        print(f"{self.name}: resumed from step {ck['step']} of {self.steps} ({path})", flush=True)
        return int(ck["step"])

    def save(self, path: Path) -> None:
        """Atomically save every module's and optimizer's state, the torch RNG state, the step and the
        log, in :func:`canonical_state` form: the same state gives the same bytes whether or not the
        run was resumed on the way."""
        with atomic_path(path) as tmp:
            ck = {"format": CKPT_FORMAT, "modules": {k: m.state_dict() for k, m in self.modules.items()},
                  "optimizers": [o.state_dict() for o in self.optimizers], "torch_rng": torch.get_rng_state(),
                  "step": len(self.log) and int(self.log[-1][0]), "log": self.log, "run_hash": self.run_hash}
            torch.save(canonical_state({**ck, "digest": state_digest(ck)}), tmp)


def canonical_state(obj: Any) -> Any:
    """``obj`` (nested dicts, lists and tuples of tensors and plain values) rebuilt with every string
    interned (``sys.intern``), tensors untouched. Pickle writes a string it has already written as
    a back-reference to the same object: an uninterrupted run's optimizer state holds the very
    ``"step"`` string of the checkpoint's own key, a resumed one new strings read from the
    checkpoint, so the same state pickled to different bytes. With one object per distinct string
    the bytes depend only on the content."""
    import sys

    if isinstance(obj, str):
        return sys.intern(obj)
    if isinstance(obj, dict):  # an OrderedDict (a module's state) stays one, with its _metadata
        out = type(obj)((canonical_state(k), canonical_state(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = canonical_state(obj._metadata)
        return out
    if isinstance(obj, list):
        return [canonical_state(x) for x in obj]
    if isinstance(obj, tuple):
        return tuple(canonical_state(x) for x in obj)
    return obj


def loss_metrics(m: dict[str, Any], columns: Sequence[str]) -> dict[str, Any]:
    """:meth:`TrainLoop.run`'s metrics with ``first``/``final`` as ``first_loss`` and ``final_loss``
    (the first column) and ``final_<column>`` for every other column."""
    first, final = m.pop("first"), m.pop("final")
    extra = {f"final_{c}": final[i] for i, c in enumerate(columns) if i and final}
    return {**m, "first_loss": first[0] if first else None, "final_loss": final[0] if final else None, **extra}


@dataclass
class _Pending:
    """One step's record until its read-back (:meth:`TrainLoop._read_back`): its values, checks
    (``(step, what, value)``) and gradient norms, 0-dim device tensors or floats."""
    step: int
    lr: float
    values: list
    checks: list
    norms: list
    tokens: int
    seconds: float
    data_seconds: float


def _to_host(xs: list) -> list[float]:
    """``xs`` (0-dim tensors of one device, or numbers) as floats, the tensors copied in one transfer."""
    where = [i for i, x in enumerate(xs) if isinstance(x, torch.Tensor)]
    if where:
        dev = xs[where[0]].device
        got = torch.stack([xs[i].detach().reshape(()).to(dev, torch.float64) for i in where]).tolist()
        xs = list(xs)
        for i, v in zip(where, got):
            xs[i] = v
    return [float(x) for x in xs]
