"""One training loop for every block: resumable, deterministic, logged.

Each block has its own parameters, optimizer (AdamW), data order and noise stream, all derived
from its seed and index, and checkpoints atomically every ``checkpoint_every`` steps into its own
work folder. A run killed at any step and started again resumes from the last checkpoint and ends
with the same bytes as an uninterrupted run.
"""
from __future__ import annotations

import csv
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from .atomic import atomic_path
from .boundary_store import BoundaryReader
from .device import autocast
from .objectives import OBJECTIVES, ObjectiveContext, regression_loss

CKPT = "checkpoint.pt"
FINAL_STATE = "train_state.pt"  # the last step's weights, optimizer and RNG state (same layout as a checkpoint)


def block_seed(seed: int, block: int) -> int:
    """The RNG seed of block ``block`` in an experiment seeded ``seed`` (distinct per block)."""
    return int(np.random.SeedSequence([int(seed), int(block)]).generate_state(1)[0])


def data_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Permutation of ``range(n)`` for ``epoch`` (int64); a pure function of its arguments."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def lr_at(step: int, total: int, lr: float, warmup: int) -> float:
    """Learning rate at ``step``: linear warmup over ``warmup`` steps, then cosine to 10% of ``lr``."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def total_steps(n_train: int, t: Mapping[str, Any]) -> int:
    """Optimizer steps for a block: ``max_steps`` if set, else ``ceil(epochs * batches_per_epoch)``."""
    if int(t["max_steps"]):
        return int(t["max_steps"])
    per_epoch = (n_train + int(t["batch_size"]) - 1) // int(t["batch_size"])
    return max(1, math.ceil(float(t["epochs"]) * per_epoch))


def train_block(block: torch.nn.Module, reader: BoundaryReader, b_in: int, b_out: int, t: Mapping[str, Any],
                seed: int, work: Path, run_hash: str,
                progress: Callable[[int, int, float], None] | None = None) -> dict[str, Any]:
    """Train ``block`` to map boundary ``b_in`` to boundary ``b_out`` under objective ``t["objective"]``.

    Args:
        block: a :class:`~zgcore.adapters.StudentBlock` (float32), modified in place.
        reader: the boundary store. t: the block's resolved train settings.
        seed: the block's own seed (see :func:`block_seed`). work: folder for checkpoints and logs
            (kept across interruptions). run_hash: the task's hash; a checkpoint written under
            another hash is never resumed from.
        progress: called as ``progress(step, total_steps, loss)``.

    Returns:
        Metrics: ``steps``, ``final_loss`` (mean of the last 10% of steps), ``seconds`` (wall, s),
        ``data_seconds``, ``compute_seconds``, ``resumed_from``.
    """
    device = next(block.parameters()).device
    n = reader.n("train")
    steps = total_steps(n, t)
    bs = int(t["batch_size"])
    per_epoch = (n + bs - 1) // bs
    params = [p for p in block.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=float(t["lr"]), weight_decay=float(t["weight_decay"]))
    target_scale = reader.stats(b_out if t["objective"] != "denoise" else b_in)
    in_scale = reader.stats(b_in)
    make_pair = OBJECTIVES[t["objective"]]
    work.mkdir(parents=True, exist_ok=True)
    log: list[tuple[int, float, float]] = []
    start = 0
    ckpt_path = work / CKPT
    ck = load_checkpoint(ckpt_path) if ckpt_path.exists() else None
    if ck is not None:
        if ck.get("run_hash") == run_hash:
            block.load_state_dict(ck["block"])
            opt.load_state_dict(ck["optimizer"])
            torch.set_rng_state(ck["torch_rng"])
            start, log = int(ck["step"]), [tuple(r) for r in ck["log"]]
            print(f"block {b_in}->{b_out}: resumed from step {start} of {steps} ({ckpt_path})", flush=True)
        else:
            print(f"block {b_in}->{b_out}: ignoring {ckpt_path}, written by another configuration", flush=True)
    resumed_from = start
    block.train()
    t0 = time.perf_counter()
    data_s = compute_s = 0.0
    bar = tqdm(total=steps, initial=start, desc=f"block {b_in}->{b_out}", unit="step")
    step = start
    while step < steps:
        epoch, k = divmod(step, per_epoch)
        order = data_order(n, seed, epoch)
        t_prev = time.perf_counter()
        for _, x, y in reader.batches("train", b_in, b_out, order, bs, start=k):
            x, y = x.to(device), y.to(device)
            t1 = t_prev  # reading (or, online, computing) the batch happened inside the iterator
            gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
            inp, target = make_pair(x, y, ObjectiveContext(gen, float(t.get("noise", 0.0)), in_scale))
            t2 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, float(t["lr"]), int(t["warmup_steps"]))
            with autocast(device):
                pred = block(inp)
            loss = regression_loss(pred.float(), target, t["loss_norm"], target_scale)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if float(t["grad_clip"]) > 0:
                torch.nn.utils.clip_grad_norm_(params, float(t["grad_clip"]))
            opt.step()
            t3 = time.perf_counter()
            data_s += t2 - t1
            compute_s += t3 - t2
            t_prev = time.perf_counter()
            step += 1
            value = loss.item()
            log.append((step, value, opt.param_groups[0]["lr"]))
            bar.update(1)
            bar.set_postfix(loss=f"{value:.4f}")
            if progress:
                progress(step, steps, value)
            if step % int(t["checkpoint_every"]) == 0 and step < steps:
                save_checkpoint(ckpt_path, block, opt, step, log, run_hash)
            if step >= steps:
                break
    bar.close()
    save_checkpoint(work / FINAL_STATE, block, opt, step, log, run_hash)  # optimizer + RNG state of the end
    tail = [l for _, l, _ in log[-max(1, len(log) // 10):]]
    with atomic_path(work / "loss_log.csv") as tmp, open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "lr"])
        w.writerows(log)
    return {"steps": steps, "final_loss": float(np.mean(tail)), "first_loss": log[0][1] if log else None,
            "seconds": time.perf_counter() - t0, "data_seconds": data_s, "compute_seconds": compute_s,
            "resumed_from": resumed_from}


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """Load a checkpoint onto the CPU, or return ``None`` (after moving the file aside to
    ``*.corrupt`` and saying so) when it cannot be read or lacks a field: a damaged checkpoint is
    never used. CPU, whatever the training device: ``torch.set_rng_state`` takes only a CPU
    ``ByteTensor``, and ``load_state_dict`` copies weights and optimizer state to the device."""
    try:
        ck = torch.load(path, map_location="cpu", weights_only=False)
        missing = {"block", "optimizer", "torch_rng", "step", "log", "run_hash"} - set(ck)
        if missing:
            raise KeyError(f"fields missing: {sorted(missing)}")
        return ck
    except Exception as e:  # truncated zip, pickle error, wrong type...
        bad = path.with_name(path.name + ".corrupt")
        os.replace(path, bad)
        print(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); moved to {bad}, starting from step 0", flush=True)
        return None


def save_checkpoint(path: Path, block: torch.nn.Module, opt: torch.optim.Optimizer, step: int, log: list, run_hash: str) -> None:
    """Atomically save block weights, optimizer state, torch RNG state, step and loss log."""
    with atomic_path(path) as tmp:
        torch.save({"block": block.state_dict(), "optimizer": opt.state_dict(), "torch_rng": torch.get_rng_state(),
                    "step": step, "log": log, "run_hash": run_hash}, tmp)


def save_weights(path: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """Save layer weights (e.g. ``StudentBlock.layer_state_dict()``) as safetensors, atomically."""
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp))
