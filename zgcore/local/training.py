"""Local-learning training and evaluation: the data order every configuration shares, the two
execution modes (``together``, ``per_block``) as step functions of the one training loop
(:class:`zgcore.training.loop.TrainLoop`: optimizers, schedule, clipping, non-finite checks, log,
checkpoints and resume), their measured activation memory, and held-out CE per boundary.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from zgcore.checks import ConfigError
from zgcore.data.order import data_order
from zgcore.device import to_device
from zgcore.training.loop import StepInfo, TrainLoop
from zgcore.training.memory import measure_peak
from zgcore.evaluation.metrics import cross_entropies
from .config import ONE_PROCESS, steps_for
from .model import LocalLM


def batch_indices(n: int, batch_size: int, data_seed: int, step: int) -> np.ndarray:
    """Rows of the train split in batch ``step``: a stream of per-epoch permutations
    (``zgcore.training.loop.data_order(n, data_seed, epoch)``) read ``batch_size`` at a time. A pure
    function of its arguments, so every configuration with the same data seed and batch size sees
    the same token ids in the same order. Returns ``[batch_size]`` int64."""
    lo = step * batch_size
    out: list[int] = []
    while len(out) < batch_size:
        epoch, pos = divmod(lo + len(out), n)
        perm = data_order(n, data_seed, epoch)
        out.extend(perm[pos: pos + batch_size - len(out)].tolist())
    return np.asarray(out, dtype=np.int64)


def _checked(loop: TrainLoop, step: int, j: int, info: Mapping[str, float]) -> Mapping[str, float]:
    for key, v in info.items():
        loop.check(step, f"block {j}'s {key} loss", v)
    return info


def step_together(lm: LocalLM, ids: torch.Tensor, loop: TrainLoop, step: int) -> list[dict[str, float]]:
    """All blocks on one batch: every forward, one backward over the sum of the block losses
    (the detached inputs keep the blocks' gradients separate), then each block's optimizer steps
    (:meth:`TrainLoop.update`: norm check, clipping). Returns per-block loss info (nats/token)."""
    loop.zero_grad()
    losses, infos = [], []
    for j, _h, loss, info in lm.blocks(ids):
        infos.append(_checked(loop, step, j, info))
        losses.append(loss)
    sum(losses[1:], losses[0]).backward()
    for j in range(lm.k):
        loop.update(j, step)
    return infos


def step_per_block(lm: LocalLM, ids: torch.Tensor, loop: TrainLoop, step: int) -> list[dict[str, float]]:
    """Deployment-style: block by block, forward, backward and optimizer step, keeping only the
    detached boundary activation ``[B, T, d]`` for the next block (its graph is freed first).
    Computes the same update as :func:`step_together`. Returns per-block loss info."""
    infos = []
    for j, _h, loss, info in lm.blocks(ids):
        infos.append(_checked(loop, step, j, info))
        loop.zero_grad(j)
        loss.backward()
        loop.update(j, step)
    return infos


STEPS = {"together": step_together, "per_block": step_per_block}


def measure_activation_memory(lm: LocalLM, ids: torch.Tensor, mode: str) -> dict[str, Any]:
    """Peak activation memory of one forward+backward of ``lm`` on ``ids`` ``[B, T]`` in execution
    ``mode`` (no optimizer step; gradients are cleared afterwards, so parameters are untouched).

    Returns:
        ``{"mode", "saved_peak_bytes", "cuda_peak_bytes"}``: bytes, the second ``None`` off CUDA
        (see :func:`zgcore.training.memory.measure_peak`). Raises :class:`ConfigError` for an unknown mode.
    """
    if mode not in ONE_PROCESS:
        raise ConfigError(f"execution mode must be one of {ONE_PROCESS}, got {mode!r}")

    def forward_backward() -> None:
        if mode == "together":
            losses = lm.block_losses(ids)
            sum(losses[1:], losses[0]).backward()
        else:
            for _j, _h, loss, _info in lm.blocks(ids):
                loss.backward()
    return {"mode": mode, **measure_peak(lm.parameters(), forward_backward, ids.is_cuda)}


def train_local(lm: LocalLM, train_tokens: np.ndarray, t: Mapping[str, Any], device: str = "cpu",
                progress: Callable[[int, int, Sequence[float]], None] | None = None,
                work: Path | None = None, run_hash: str = "", name: str = "local learning",
                callbacks: Sequence[Callable[[StepInfo], None]] = ()) -> dict[str, Any]:
    """Pretrain ``lm`` on ``train_tokens`` (``[n, T]`` model ids, int64) for the token budget.

    Each block has its own AdamW (``lr`` with linear warmup then cosine to 10%, ``weight_decay``,
    gradient clipping per block) in one :class:`~zgcore.training.loop.TrainLoop`; batches follow
    :func:`batch_indices` with ``data_seed``. Before the first step, peak activation memory of the
    first batch is measured in both execution modes (:func:`measure_activation_memory`).

    Args:
        progress: called as ``progress(step, steps, values)`` every ``log_every`` steps and at the
            end; ``values`` = CE per block, then MTP CE per block (NaN where there is none).
        work: folder for checkpoints (every ``checkpoint_every`` steps), ``loss_log.csv`` and
            ``train_state.pt``; a run started again resumes bitwise from its last checkpoint.
            ``None``: nothing on disk. run_hash: a checkpoint of another hash is never resumed.
        callbacks: :class:`~zgcore.training.loop.TrainLoop` callbacks (e.g. :class:`zgcore.training.watch.TensorBoardWatch`).

    Returns:
        ``{"steps", "tokens", "tokens_sha256" (of the int64 model ids seen, in order), "seconds",
        "first_loss", "final_loss" (per block, nats/token; final = mean of the last 10% of
        steps), "memory": {mode: measurement}, "memory_ratio" (together / per_block), ...}``.

    Raises:
        zgcore.training.loop.NonFiniteError: a non-finite loss or gradient norm (the last checkpoint stays).
    """
    seq_len = train_tokens.shape[1]
    steps = steps_for(t, seq_len)
    bsz, data_seed = int(t["batch_size"]), int(t["data_seed"])
    first = to_device(torch.as_tensor(train_tokens[batch_indices(len(train_tokens), bsz, data_seed, 0)]), device)
    if t["execution"] not in STEPS:
        raise ConfigError(f"train_local runs train.execution in {tuple(STEPS)}; {t['execution']!r} runs through "
                          f"zgcore.local.pipeline.train_pipeline")
    memory = {m: measure_activation_memory(lm, first, m) for m in ONE_PROCESS}
    cols = [f"ce_b{j + 1}" for j in range(lm.k)] + [f"mtp_b{j + 1}" for j in range(lm.k)]
    loop = TrainLoop(name, [lm.block_params(j) for j in range(lm.k)], t, steps, work, run_hash, {"lm": lm}, cols, callbacks=callbacks)
    step_fn = STEPS[t["execution"]]
    sha = hashlib.sha256()

    def batches(start: int) -> Iterator[torch.Tensor]:
        for step in range(steps):  # the steps before ``start`` are hashed, not trained
            batch = np.ascontiguousarray(train_tokens[batch_indices(len(train_tokens), bsz, data_seed, step)], dtype=np.int64)
            sha.update(batch.tobytes())
            if step >= start:
                yield to_device(torch.from_numpy(batch), device)

    def one_step(ids: torch.Tensor, step: int) -> list[float]:
        infos = step_fn(lm, ids, loop, step)
        return [i["ce"] for i in infos] + [i.get("mtp", float("nan")) for i in infos]

    every = int(t.get("log_every", 10))
    report = (lambda s, n, v: progress(s, n, v) if (s - 1) % every == 0 or s == n else None) if progress else None
    lm.train()
    m = loop.run(batches, one_step, report)
    sp = {mode: memory[mode]["saved_peak_bytes"] for mode in ONE_PROCESS}
    return {"steps": steps, "tokens": steps * bsz * seq_len, "tokens_sha256": sha.hexdigest(), "seconds": m["seconds"],
            "data_seconds": m["data_seconds"], "compute_seconds": m["compute_seconds"], "resumed_from": m["resumed_from"],
            "first_loss": m["first"][: lm.k], "final_loss": m["final"][: lm.k], "memory": memory,
            "memory_ratio": sp["together"] / sp["per_block"] if sp["per_block"] else float("nan")}


def evaluate_local(lm: LocalLM, tokens: np.ndarray, batch_size: int = 16) -> dict[str, Any]:
    """Held-out next-token CE (nats/token) at every boundary ``1..K`` (aux heads, then the model's
    own head at boundary K) over ``tokens`` ``[n, T]`` model ids, averaged over ``n * (T-1)``
    predictions (:func:`zgcore.evaluation.metrics.cross_entropies`). Returns ``{"boundary_ce": [K floats],
    "final_ce": boundary_ce[-1]}``."""
    lm.eval()
    device = next(lm.parameters()).device

    def logits_of(ids: torch.Tensor) -> list[torch.Tensor]:
        ctx = lm.context(ids)
        return [lm.boundary_logits(j, h, ctx)[0] for j, h, _loss, _info in lm.blocks(ids, ctx, losses=False)]
    ce = cross_entropies(logits_of, tokens, batch_size, device, desc="CE per boundary")
    return {"boundary_ce": ce, "final_ce": ce[-1]}


def _smoke(folder: Path, settings: Mapping[str, Any], execution: str = "together") -> dict[str, Any]:
    """A training path's seconds-long run (:mod:`zgcore.training.paths`): :func:`smoke_setup`'s model
    and data, trained in this process."""
    lm, data, _, t = smoke_setup(settings, execution)
    return train_local(lm, data, t, work=folder / "work", run_hash="smoke")


def smoke_setup(settings: Mapping[str, Any], execution: str = "together"):
    """What a local-learning smoke run trains: ``(lm, tokens, run, t)``, a K = 2 local-learning Llama
    (4 layers of width 32, MLP aux heads; vocabulary 50), 24 random sequences of 16 tokens (int64
    ``[24, 16]``), its normalised configuration and train settings with the smoke's
    ``log_every``/``checkpoint_every`` from ``settings`` (``max_steps`` sets the token budget)."""
    from .config import LOCAL_DEFAULTS, normalise_run
    from .model import build_local

    steps = int(settings["max_steps"])
    train = {**LOCAL_DEFAULTS["train"], "token_budget": steps * 4 * 16, "batch_size": 4, "lr": 3e-3, "warmup_steps": 1,
             "seed": 0, "data_seed": 0, "execution": execution}
    loc = {**LOCAL_DEFAULTS["local"], "K": 2, "aux": "mlp", "mtp_boundaries": [], "mtp_n": 2}
    model = {"n_layers": 4, "hidden_size": 32, "intermediate_size": 64, "n_heads": 4, "n_kv_heads": 2,
             "rope_theta": 10000.0, "vocab": "compact"}
    run = normalise_run({"model": model, "train": train, "local": loc})
    t = {**run["train"], **{k: settings[k] for k in ("log_every", "checkpoint_every") if k in settings}}
    data = np.random.default_rng(1).integers(0, 50, size=(24, 16)).astype(np.int64)
    return build_local(run, 50, 16), data, run, t


def _register() -> None:
    from functools import partial

    from zgcore.training.paths import register_path

    for mode in ONE_PROCESS:  # the pipeline's stages run this module's TrainLoop in processes of their own
        register_path(f"local/{mode}", __name__, partial(_smoke, execution=mode))


_register()
