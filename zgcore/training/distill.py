"""End-to-end logit distillation of a whole student against the frozen teacher, on the one
training loop: the healing stage after Assemble (``heal.*``) and the end-to-end arm of the
distillation study. Also the matching of its budget to blockwise training, and a per-task peak
resident-memory meter.

The loss is the token-mean KL divergence from the teacher's to the student's next-token
distribution at temperature ``T``, times ``T**2`` (Hinton et al. 2015, "Distilling the Knowledge
in a Neural Network"), plus optionally ``hidden_weight`` times the mean, over the interior
boundaries, of the per-token normalised squared error between the student's and the teacher's
residual streams there (:func:`zgcore.training.objectives.regression_loss` with ``"token"``). Only the
student's decoder layers train; its embedding, final norm and LM head stay the teacher's (as in
the blockwise arm, where blocks own only layers).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from zgcore.device import autocast, to_device
from zgcore.data.feed import block_batches
from zgcore.data.logit_store import LOGITS, online_targets, open_store, unpack
from zgcore.data.order import batch_walk
from zgcore.models.shapes import check_one_width
from zgcore.training.loop import StepInfo, TrainLoop, loss_metrics
from zgcore.training.objectives import regression_loss
from zgcore.training.topk import topk_kd_loss

STORE_AHEAD = 2  # batches of records read ahead of the step by the input pipeline's worker thread


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``T**2`` times the mean over positions of KL(teacher || student) of the softmax at temperature ``T``.

    Args:
        student_logits, teacher_logits: ``[batch, seq, vocab]`` (scored in float32).
        temperature: ``T`` > 0.

    Returns:
        A scalar float32 tensor (nats/token at ``T = 1``).
    """
    s = torch.log_softmax(student_logits.float() / temperature, -1)
    t = torch.log_softmax(teacher_logits.float() / temperature, -1)
    return (t.exp() * (t - s)).sum(-1).mean() * temperature ** 2


def e2e_steps(block_passes: Sequence[tuple[int, int, int]], student_layers: int, batch_size: int) -> int:
    """End-to-end steps at the same number of student layer-token forward/backward passes as blockwise training.

    One blockwise step of block ``i`` (``steps_i`` steps of ``batch_i`` sequences through
    ``layers_i`` student layers) costs ``batch_i * seq_len * layers_i`` layer-token passes; one
    end-to-end step costs ``batch_size * seq_len * student_layers``. The sequence length cancels.

    Args:
        block_passes: per block ``(steps_i, batch_i, layers_i)``.

    Returns:
        ``ceil(sum_i steps_i * batch_i * layers_i / (batch_size * student_layers))``, at least 1.
    """
    total = sum(s * b * n for s, b, n in block_passes)
    return max(1, math.ceil(total / (batch_size * student_layers)))


def initial_student(teacher, bounds: Sequence[int], blocks: Sequence[Mapping[str, Any]],
                    n_train: int, measured: Mapping[str, Any] | None = None, head: torch.nn.Module | None = None,
                    ) -> tuple[torch.nn.Module, list[tuple[int, int]], list[tuple[int, int, int]]]:
    """The blockwise arm's student before training, whole: the same kept layers, MLP widths and
    initialisation as each ``TrainBlock`` (``build_block`` with the block's own seed), assembled.

    Args:
        teacher: the teacher causal LM, or a :class:`zgcore.models.teacher_weights.LazyLayers`
            (then ``head`` is required). bounds: boundary layer indices ``b_0 = 0 < ... < b_K``.
        blocks: each block's resolved train settings. n_train: training sequences (for step counts).
        measured: the ``LayerImportance`` measurements (``influence``, ``channels``) when a block
            keeps layers by importance or narrows its MLP (:func:`zgcore.models.students.needs_measure`).
        head: the teacher's embedding, final norm and LM head (:func:`zgcore.models.teacher_weights.load_head`)
            to assemble the student with, instead of ``teacher``'s.

    Raises:
        zgcore.config.experiment.ConfigError: blocks of different MLP widths (:func:`check_one_width`).

    Returns:
        ``(student, pairs, passes)``: the assembled float32 student; the interior boundaries as
        ``(student_layer, teacher_layer)``; per block ``(steps, batch_size, student_layers)`` for :func:`e2e_steps`.
    """
    from zgcore.models.adapters import assemble, build_block
    from zgcore.models.shapes import kept_layers
    from zgcore.training.blocks import block_seed, total_steps

    check_one_width(blocks)
    measured = measured or {}
    built, pairs, passes, offset = [], [], [], 0
    for i, t in enumerate(blocks):
        kept = kept_layers(bounds[i], bounds[i + 1], t, measured.get("influence"))
        built.append(build_block(teacher, kept, t["init"], block_seed(int(t["seed"]), i),
                                 intermediate_size=t.get("intermediate_size"), channels=measured.get("channels")))
        passes.append((total_steps(n_train, t), int(t["batch_size"]), len(kept)))
        offset += len(kept)
        if i + 1 < len(blocks):
            pairs.append((offset, bounds[i + 1]))
    return assemble(head if head is not None else teacher, built), pairs, passes


def e2e_block_settings(t: Mapping[str, Any], matched: bool) -> dict[str, Any]:
    """The settings of one block's resolved train section ``t`` that decide the end-to-end arm's
    result (what its hash covers): the student's shape and initialisation (``keep``, ``init``,
    ``n_layers`` or else ``keep_fraction``, ``intermediate_size`` when set, ``seed`` only with
    ``init="random"``) and, when its step count is ``matched`` to the blockwise arm, that
    block's step count (``batch_size``, ``max_steps`` or else ``epochs``). The blockwise
    optimisation settings (lr, objective, noise, ...) train nothing here and are left out."""
    keys = ["keep", "init", "n_layers" if t.get("n_layers") is not None else "keep_fraction"]
    keys += ["intermediate_size"] if t.get("intermediate_size") is not None else []
    keys += ["seed"] if t["init"] == "random" else []
    if matched:
        keys += ["batch_size", "max_steps" if int(t.get("max_steps") or 0) else "epochs"]
    return {k: t[k] for k in keys}


def _residuals(model: torch.nn.Module, ids: torch.Tensor, layers: Sequence[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Logits and the raw residual stream at the input of each of ``layers`` (all < the layer count)."""
    out = model(input_ids=ids, use_cache=False, output_hidden_states=bool(layers))
    return out.logits, ({j: out.hidden_states[j] for j in layers} if layers else {})


def _final_hidden(model: torch.nn.Module, ids: torch.Tensor, layers: Sequence[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The final hidden states (after the final norm) ``[B, S, H]`` of a causal LM's base model,
    without its LM head, and the raw residual stream at the input of each of ``layers``."""
    from zgcore.models.adapters import adapter_for

    out = adapter_for(model).base_model(model)(input_ids=ids, use_cache=False, output_hidden_states=bool(layers))
    return out.last_hidden_state, ({j: out.hidden_states[j] for j in layers} if layers else {})


def _open_store(store: str | Path, k: int, temperature: float, n: int):
    """The logit store's reader, checked to hold ``n`` training sequences of top-``k`` records."""
    from zgcore.data.boundary_store import BoundaryStoreError

    r = open_store(store, k, temperature)
    if r.n("train") != n:
        r.close()
        raise BoundaryStoreError(f"{r.root}: {r.n('train')} training sequences, but the corpus has {n}")
    return r


@dataclass(frozen=True)
class DistillRun:
    """What one end-to-end distillation run takes besides the models and the tokens (:func:`distill`).

    Attributes:
        h: settings as :data:`zgcore.config.defaults.HEAL_DEFAULTS` (``lr``, ``batch_size``, ``temperature``,
            ``top_k``, ``hidden_weight``, ``warmup_steps``, ``weight_decay``, ``grad_clip``, ``checkpoint_every``).
        steps: optimizer steps. seed: the data order's (:func:`zgcore.data.order.batch_walk`).
        work: checkpoint folder (kept across interruptions); ``None`` = nothing on disk.
        run_hash: the task's hash; a checkpoint written under another hash is never resumed from.
        pairs: ``(student_layer, teacher_layer)`` interior boundaries of the hidden-state term
            (the input of those layers); used when ``hidden_weight`` > 0.
        name: used in messages. section: the configuration section of ``h`` (``"heal"`` or ``"distill"``),
            named in errors.
        progress: ``progress(step, steps, values)``.
        callbacks: :class:`~zgcore.training.loop.TrainLoop` callbacks
            (e.g. :class:`zgcore.training.watch.TensorBoardWatch`).
        store: the top-k logit store's join folder (needs ``top_k`` > 0 and ``hidden_weight`` = 0;
            its manifest must say ``top_k`` and ``temperature`` and hold the corpus's training sequences).
    """
    h: Mapping[str, Any]
    steps: int
    seed: int
    work: Path | None
    run_hash: str
    pairs: Sequence[tuple[int, int]] = ()
    name: str = "distill"
    section: str = "heal"
    progress: Callable[[int, int, Sequence[float]], None] | None = None
    callbacks: Sequence[Callable[[StepInfo], None]] = ()
    store: str | Path | None = None


def distill(student: torch.nn.Module, teacher: torch.nn.Module | None, tokens: np.ndarray,
            run: DistillRun) -> dict[str, Any]:
    """Train ``student``'s decoder layers end to end on the teacher's logits (and hidden states).

    With ``h["top_k"]`` = 0 the loss is the full-vocabulary :func:`kd_loss`; with ``top_k`` > 0 it
    is :func:`zgcore.training.topk.topk_kd_loss` on the teacher's top-k targets, computed online
    (:func:`zgcore.data.logit_store.online_targets`) or read from the top-k logit ``store``
    through the prefetching input pipeline (:func:`zgcore.data.feed.block_batches`): the same
    bits either way, so the two train byte-identical students.

    Args:
        student: an HF causal LM of the teacher's family (float32), modified in place.
        teacher: the frozen teacher (same vocabulary); ``None`` with a ``store`` (cached targets).
        tokens: training sequences ``[n, seq_len]`` int64.
        run: the settings, step count, seed, work folder and hooks of the run (:class:`DistillRun`).

    Returns:
        :meth:`TrainLoop.run`'s metrics with ``first_loss``/``final_loss`` and, per column,
        ``final_kd`` (and ``final_hidden``); ``tokens_seen``.

    Raises:
        zgcore.training.loop.NonFiniteError: a non-finite loss or gradient norm.
        zgcore.data.boundary_store.BoundaryStoreError: the store does not match, or a damaged shard
            (moved aside, named).
        ValueError: ``store`` without ``top_k`` > 0, with the hidden-state term, or without a teacher and store.
    """
    h, steps, seed, section, store = run.h, int(run.steps), run.seed, run.section, run.store
    device = next(student.parameters()).device
    bs, n, T = int(h["batch_size"]), len(tokens), float(h["temperature"])
    w_hidden = float(h.get("hidden_weight") or 0.0)
    pairs = list(run.pairs) if w_hidden > 0 else []
    k = int(h.get("top_k") or 0)
    if store is not None and (not k or pairs):
        raise ValueError(f"cached targets need {section}.top_k > 0 and {section}.hidden_weight = 0")
    if store is None and teacher is None:
        raise ValueError("distill needs the teacher (online targets) or a top-k logit store (cached targets)")
    columns = ["loss", "kd", "hidden"] if pairs else ["loss", "kd"]
    loop = TrainLoop(run.name, [_layers_only(student)], h, steps, run.work, run.run_hash, {"student": student}, columns,
                     section=section, callbacks=run.callbacks)
    reader = _open_store(store, k, T, n) if store is not None else None

    def batches(step: int) -> Iterator[Any]:
        if reader is not None:  # (step, idx, records, None), read ahead by a worker thread
            # on CUDA the worker reads the records straight into page-locked memory (no pageable copy)
            yield from block_batches(reader, LOGITS, None, n, seed, bs, step, steps, STORE_AHEAD,
                                     pin_memory=device.type == "cuda")
            return
        for _, idx in batch_walk(n, seed, bs, step, steps):
            yield to_device(torch.as_tensor(tokens[idx], dtype=torch.long), device)

    def step_fn(batch, step: int) -> list[torch.Tensor]:
        if reader is not None:
            _, idx, rec, _ = batch
            ids = to_device(torch.as_tensor(tokens[idx], dtype=torch.long), device)
        else:
            ids, rec = batch, None
        kd, s_hidden, t_hidden = _kd_term(student, teacher, ids, rec, k, T, pairs, device)
        # kept on the device, read back every log_every steps (TrainLoop.run): no host sync per step
        values = [loop.check(step, "the KD term", kd.detach())]
        loss = kd
        if pairs:
            hid = torch.stack([regression_loss(s_hidden[s].float(), t_hidden[t].float(), "token") for s, t in pairs]).mean()
            values.append(loop.check(step, "the hidden-state term", hid.detach()))
            loss = kd + w_hidden * hid
        return loop.step_on(step, loss, values)

    student.train()
    try:
        m = loop.run(batches, step_fn, progress=run.progress)
    finally:
        if reader is not None:
            reader.close()
    student.eval()
    return {**loss_metrics(m, columns), "tokens_seen": steps * bs * int(tokens.shape[1])}


def _layers_only(student: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Freeze ``student`` but its decoder layers (embedding, final norm and LM head stay the
    teacher's); returns the decoder layers' parameters, the ones that train."""
    from zgcore.models.adapters import adapter_for

    layers = adapter_for(student).decoder_layers(student)
    for p in student.parameters():
        p.requires_grad_(False)
    params = [p for p in layers.parameters()]
    for p in params:
        p.requires_grad_(True)
    return params


def _kd_term(student, teacher, ids: torch.Tensor, rec: torch.Tensor | None, k: int, T: float,
             pairs: Sequence[tuple[int, int]], device: torch.device):
    """One batch's KD term (a 0-dim float32 tensor) and the student's and the teacher's residual
    streams at ``pairs``: on the full vocabulary (``k`` = 0) or on the teacher's top-``k`` records
    ``rec`` (read from the store, or computed here from the teacher when ``None``)."""
    from zgcore.models.adapters import adapter_for

    t_hidden = {}
    if not k:
        with torch.no_grad(), autocast(device):
            t_logits, t_hidden = _residuals(teacher, ids, [t for _, t in pairs])
        with autocast(device):
            s_logits, s_hidden = _residuals(student, ids, [s for s, _ in pairs])
        return kd_loss(s_logits, t_logits, T), s_hidden, t_hidden
    if rec is None:  # online: the teacher's records, as the store would hold them
        with autocast(device):
            rec = online_targets(teacher, ids, k, T)
    if pairs:
        with torch.no_grad(), autocast(device):
            _, t_hidden = _residuals(teacher, ids, [t for _, t in pairs])
    t_ids, t_logp, t_rest = unpack(to_device(rec, device), k)
    ad = adapter_for(student)

    def head(hid: torch.Tensor) -> torch.Tensor:
        return ad.finish_logits(student.config, student.get_output_embeddings()(hid))

    with autocast(device):
        hidden, s_hidden = _final_hidden(student, ids, [s for s, _ in pairs])
        kd = topk_kd_loss(hidden, head, t_ids, t_logp, t_rest, T)
    return kd, s_hidden, t_hidden


def _smoke(folder: Path, settings: Mapping[str, Any], top_k: int = 0, cached: bool = False, hidden: float = 0.0,
           section: str = "distill") -> dict[str, Any]:
    """A training path's seconds-long run (:mod:`zgcore.training.paths`): a tiny random Llama
    distilled into a copy of itself on 16 random sequences of 16 tokens."""
    import copy

    from zgcore.data.boundary_store import join_shards
    from zgcore.data.logit_store import store_extra, write_logit_shard
    from zgcore.training.paths import smoke_settings, tiny_teacher

    teacher = tiny_teacher(folder)
    student = copy.deepcopy(teacher)
    rng = np.random.default_rng(0)
    tokens = {"train": rng.integers(0, 256, (16, 16)).astype(np.int64), "val": rng.integers(0, 256, (4, 16)).astype(np.int64)}
    h = smoke_settings({"lr": 1e-3, "batch_size": 4, "temperature": 1.0, "top_k": top_k, "hidden_weight": hidden,
                        "warmup_steps": 0, "weight_decay": 0.0, "grad_clip": 1.0}, settings)
    store = None
    if cached:
        store, extra = folder / "logits", store_extra(top_k, 1.0)
        store.mkdir()
        for split in ("train", "val"):
            (folder / split).mkdir()
            write_logit_shard(folder / split, teacher, tokens[split], split, 0, top_k, 1.0, 4, extra)
        join_shards(store, [folder / "train", folder / "val"], {s: len(v) for s, v in tokens.items()}, extra)
    pairs = [(1, 1)] if hidden else []
    return distill(student, None if cached else teacher, tokens["train"],
                   DistillRun(h, int(h["max_steps"]), 0, folder / "work", "smoke", pairs=pairs, section=section,
                              store=store))


def _register() -> None:
    from functools import partial

    from zgcore.training.paths import register_path

    register_path("heal", __name__, partial(_smoke, hidden=0.5, section="heal"))
    register_path("distill/full vocabulary", __name__, _smoke)
    register_path("distill/top-k online", __name__, partial(_smoke, top_k=8))
    register_path("distill/top-k cached", __name__, partial(_smoke, top_k=8, cached=True))


_register()
