"""ZeroGraph block training: one student block learns boundary i -> i+1 on :class:`~zgcore.training.loop.TrainLoop`.

Each block has its own parameters, optimizer (AdamW), data order and noise stream, all derived
from its seed and index; the loop checkpoints atomically every ``checkpoint_every`` steps into the
block's own work folder, so a run killed at any step and started again resumes from the last
checkpoint and ends with the same bytes as an uninterrupted run. Also here: the block's step
count, the effective train settings (what a block's hash covers) and the weight writer.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from safetensors.torch import save_file

from zgcore.atomic import atomic_path
from zgcore.data.boundary_store import BoundaryReader
from zgcore.device import autocast, to_device
from zgcore.data.feed import block_batches
from zgcore.data.order import batch_walk, total_steps  # noqa: F401 (total_steps re-exported)
from zgcore.training.loop import CKPT, FINAL_STATE, LOSS_LOG, NonFiniteError, TrainLoop, load_checkpoint, lr_at  # noqa: F401 (re-exported)
from zgcore.training.loop import StepInfo, loss_metrics, state_digest  # noqa: F401 (state_digest re-exported)
from zgcore.training.objectives import OBJECTIVES, ObjectiveContext, aux_active, aux_losses, regression_loss


def block_seed(seed: int, block: int) -> int:
    """The RNG seed of block ``block`` in an experiment seeded ``seed`` (distinct per block)."""
    return int(np.random.SeedSequence([int(seed), int(block)]).generate_state(1)[0])


@dataclass(frozen=True)
class BlockTraining:
    """What one block's training run takes besides the block and its data (:func:`train_block`).

    Attributes:
        t: the block's resolved train settings.
        seed: the block's own seed (see :func:`block_seed`).
        work: folder for checkpoints and logs (kept across interruptions); ``None`` = nothing on disk.
        run_hash: the task's hash; a checkpoint written under another hash is never resumed from.
        name: used in messages (default ``"block <b_in>-><b_out>"``).
        progress: called as ``progress(step, total_steps, loss)``.
        head: the teacher's frozen final norm and LM head, residual stream ``[B, T, H]`` float32 to
            logits ``[B, T, V]`` (e.g. ``lambda h: head_logits(teacher, h)``); needed by the auxiliary terms.
        tokens: the train split's token ids ``[n_train, T]`` int64, in the store's sequence order
            (``tokens[i]`` produced boundary sequence ``i``); needed by the auxiliary terms.
        callbacks: :class:`~zgcore.training.loop.TrainLoop` callbacks
            (e.g. :class:`zgcore.training.watch.TensorBoardWatch`).
        transfer: objective ``attention_transfer``: the block's input ``[B, T, H]`` -> its attention-transfer
            loss (:func:`zgcore.training.transfer.transfer_loss`), the loss of the first ``t["transfer_steps"]`` steps.
    """
    t: Mapping[str, Any]
    seed: int
    work: Path | None
    run_hash: str
    name: str | None = None
    progress: Callable[[int, int, float], None] | None = None
    head: Callable[[torch.Tensor], torch.Tensor] | None = None
    tokens: np.ndarray | None = None
    callbacks: Sequence[Callable[[StepInfo], None]] = ()
    transfer: Callable[[torch.Tensor], torch.Tensor] | None = None


def train_block(block: torch.nn.Module, reader: BoundaryReader, b_in: int, b_out: int,
                run: BlockTraining) -> dict[str, Any]:
    """Train ``block`` to map boundary ``b_in`` to boundary ``b_out`` under objective ``run.t["objective"]``.

    The loss is :func:`~zgcore.training.objectives.regression_loss` with ``t["loss_norm"]``; its channel
    scale comes from the boundary the objective names (:meth:`~zgcore.training.objectives.Objective.scale_boundary`).
    With ``t["ce_weight"]`` or ``t["mtp_weight"]`` > 0 the local auxiliary terms of
    :func:`~zgcore.training.objectives.aux_losses` on ``head(block(input))`` are added with those weights;
    the loss log then has the columns ``loss`` (the total), ``regression``, and ``ce`` / ``mtp``.

    From a :class:`~zgcore.data.boundary_store.BoundaryReader`, ``t["prefetch"]`` batches (0 = none)
    are read and checked ahead of the step by each of ``t["prefetch_workers"]``
    worker threads or processes (``t["prefetch_mode"]``, :func:`zgcore.data.feed.block_batches`), into page-locked memory when the block is on CUDA, and
    copied with ``non_blocking`` in the store's dtype, then widened to float32 on the device
    (``.float()``: exact, so a bfloat16 / float16 store moves half the bytes and trains the same
    weights as float32-widened batches of it): the same batches in the same order with the same bytes as a
    synchronous read, so the weights are bitwise identical either way. Online targets are
    computed synchronously.

    With ``t["compile"]`` the block's forward and backward run through ``torch.compile``
    (TorchInductor; a C compiler is needed, and the first step pays the compile). Compiled training
    is bitwise the same from run to run and on resume, but not bitwise the eager weights: the setting is hashed.

    Args:
        block: a :class:`~zgcore.models.adapters.StudentBlock` (float32), modified in place.
        reader: the boundary store (or :class:`~zgcore.data.boundary_store.OnlineBoundaries`).
        run: the settings, seed, work folder and hooks of the run (:class:`BlockTraining`).

    Returns:
        Metrics: ``steps``, ``first_loss``, ``final_loss`` (mean of the last 10% of steps),
        ``seconds`` (wall, s), ``data_seconds``, ``compute_seconds``, ``resumed_from``; with auxiliary
        terms also ``final_regression``, ``final_ce`` / ``final_mtp`` (unweighted, nats/token for the terms).

    Raises:
        NonFiniteError: a non-finite loss or gradient norm (the last checkpoint stays in ``work``).
        BoundaryStoreError: a damaged shard (also when the prefetching worker read it: the same
            error and message, raised at the step that needs the batch).
        ValueError: auxiliary terms without ``head`` and ``tokens``, or ``tokens`` of another length than the store;
            ``attention_transfer`` without ``transfer``.
    """
    t, seed, n = run.t, run.seed, reader.n("train")
    active = aux_active(t)
    transfer_steps = int(t.get("transfer_steps") or 0) if t["objective"] == "attention_transfer" else 0
    if transfer_steps and run.transfer is None:
        raise ValueError("objective attention_transfer needs the teacher partition's attention (transfer=...)")
    if active and (run.head is None or run.tokens is None or len(run.tokens) != n):
        raise ValueError(f"train.ce_weight / train.mtp_weight need the teacher's head and the {n} train token "
                         f"sequences, got head={run.head is not None}, "
                         f"tokens={None if run.tokens is None else len(run.tokens)}")
    device = next(block.parameters()).device
    objective = OBJECTIVES[t["objective"]]
    target_scale, in_scale = reader.stats(objective.scale_boundary(b_in, b_out)), reader.stats(b_in)
    params = [p for p in block.parameters() if p.requires_grad]
    loop = TrainLoop(run.name or f"block {b_in}->{b_out}", [params], t, total_steps(n, t), run.work, run.run_hash,
                     {"block": block}, ["loss", "regression", *active] if active else ["loss"], callbacks=run.callbacks)

    def pairs(step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        for s, idx, x, y in _reads(reader, b_in, b_out, n, t, seed, step, loop.steps, device):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + s)
            # the store's dtype (or a codec's bytes) over the copy, widened (decoded) on the device
            inp, target = objective.make_pair(reader.widen(to_device(x, device)), reader.widen(to_device(y, device)),
                                              ObjectiveContext(gen, float(t.get("noise", 0.0)), in_scale))
            # page-locked on CUDA: the copy does not wait for the previous step
            yield inp, target, to_device(torch.as_tensor(run.tokens[np.asarray(idx)]), device) if active else None

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], step: int) -> list[torch.Tensor]:
        inp, target, ids = batch
        if step < transfer_steps:  # attention transfer first (its loss only), then clean regression
            with autocast(device):
                loss = run.transfer(inp)
            return loop.step_on(step, loss, [loss.detach()] + [torch.zeros_like(loss)] * len(active) if active else [])
        with autocast(device):
            pred = forward(inp)
        loss = regression_loss(pred.float(), target, t["loss_norm"], target_scale)
        values = []
        if active:
            terms = aux_losses(run.head(pred.float()), ids, active, int(t.get("mtp_n") or 1))
            # kept on the device, read back every log_every steps (TrainLoop.run): no host sync per step
            values = [loss.detach()] + [loop.check(step, f"the {k} term", v.detach()) for k, v in terms.items()]
            loss = loss + sum(active[k] * v for k, v in terms.items())
        return loop.step_on(step, loss, values)

    block.train()
    # train.compile: the block's forward (and, through AOTAutograd, its backward) compiled by TorchInductor;
    # the weights stay the block's own, so checkpoints, resume and saving are unchanged
    forward = torch.compile(block) if t.get("compile") else block
    progress = run.progress
    m = loop.run(pairs, step_fn, progress=(lambda s, n_, v: progress(s, n_, v[0])) if progress else None)
    return loss_metrics(m, loop.columns)  # final_<aux term>: unweighted


def _reads(reader, b_in: int, b_out: int, n: int, t: Mapping[str, Any], seed: int, step: int, steps: int,
           device: torch.device) -> Iterator[tuple[int, np.ndarray, torch.Tensor, torch.Tensor]]:
    """``(step, idx, x, y)`` of a block's training steps from ``step`` on, on the CPU: from the boundary
    store through the input pipeline (:func:`zgcore.data.feed.block_batches`), or with online targets
    from the teacher, here, synchronously (the same walk, :func:`zgcore.data.order.batch_walk`)."""
    bs = int(t["batch_size"])
    if isinstance(reader, BoundaryReader):
        yield from block_batches(reader, b_in, b_out, n, seed, bs, step, steps, int(t.get("prefetch") or 0),
                                 device.type == "cuda", t.get("prefetch_workers") or "auto",
                                 str(t.get("prefetch_mode") or "auto"))
        return
    for s, idx in batch_walk(n, seed, bs, step, steps):
        for _, x, y in reader.batches("train", b_in, b_out, idx, len(idx)):
            yield s, idx, x, y


def val_loss(block: torch.nn.Module, reader: BoundaryReader, b_in: int, b_out: int, t: Mapping[str, Any],
             split: str = "val", batch_size: int | None = None, rows: np.ndarray | None = None) -> dict[str, Any]:
    """The block's validation loss: :func:`~zgcore.training.objectives.regression_loss` (``t["loss_norm"]``,
    per-channel scale of ``b_out``) of ``block(boundary b_in)`` against boundary ``b_out`` — the
    clean mapping every objective is after — over the sequences ``rows`` of ``split`` (int64;
    default every one), in order, no noise. What the blockwise arm's lr search scores (lower is
    better), on the rows outside the test subset (:func:`zgcore.evaluation.metrics.tune_subset`).

    Args:
        block: a trained :class:`~zgcore.models.adapters.StudentBlock` (float32; put in eval mode here).
        reader: the boundary store, or :class:`~zgcore.data.boundary_store.OnlineBoundaries` over the
            validation tokens. t: the block's train settings (``loss_norm``, ``batch_size``).

    Returns:
        ``{"val_loss" (sequence-weighted mean, dimensionless), "sequences"}``.

    Raises:
        ValueError: the split (or ``rows``) is empty.
    """
    order = np.arange(reader.n(split), dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    n = len(order)
    if not n:
        raise ValueError(f"no {split} sequences to score the block on")
    device = next(block.parameters()).device
    scale = reader.stats(b_out)
    bs = int(batch_size or t["batch_size"])
    total = 0.0
    block.eval()
    with torch.no_grad():
        for _k, x, y in reader.batches(split, b_in, b_out, order, bs):
            with autocast(device):
                pred = block(reader.widen(x.to(device)))  # the store's dtype (or codec bytes), widened on the device
            target = reader.widen(y.to(device))
            total += float(regression_loss(pred.float(), target, t["loss_norm"], scale.to(device))) * len(x)
    return {"val_loss": total / n, "sequences": int(n)}


def save_weights(path: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """Save layer weights (e.g. ``StudentBlock.layer_state_dict()``) as safetensors, atomically."""
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp))


def _smoke(folder: Path, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The training path's seconds-long run (:mod:`zgcore.training.paths`): block 0 -> 2 of a tiny
    random Llama, from a boundary store of 16 sequences, noisy objective."""
    from zgcore.data.boundary_store import build_store
    from zgcore.models.adapters import build_block
    from zgcore.training.paths import smoke_settings, tiny_teacher

    model = tiny_teacher(folder)
    rng = np.random.default_rng(0)
    tokens = {"train": rng.integers(0, 256, (16, 16)).astype(np.int32), "val": rng.integers(0, 256, (4, 16)).astype(np.int32)}
    build_store(folder / "store", model, tokens, [0, 2], "float32", 4, {}, log=lambda m: None)
    t = smoke_settings({"objective": "noisy", "noise": 0.1, "loss_norm": "channel", "lr": 1e-3, "weight_decay": 0.0,
                        "grad_clip": 1.0, "warmup_steps": 2, "epochs": 1, "batch_size": 4, "prefetch": 0}, settings)
    with BoundaryReader(folder / "store") as r:
        return train_block(build_block(model, [0, 1], "teacher", 3), r, 0, 2,
                           BlockTraining(t, 3, folder / "work", "smoke"))


def _register() -> None:
    from zgcore.training.paths import register_path

    register_path("block", __name__, _smoke)


_register()
