"""One partition's student block, from the teacher's record to the trained weights and metrics: what
the ``TrainBlock`` task asks for in one call (:func:`train_partition`), given its inputs' paths
(:class:`PartitionJob`).

The block covers teacher layers ``[b_i, b_{i+1})`` (:func:`zgcore.models.shapes.resolve_boundaries`),
keeps the layers :func:`zgcore.models.shapes.kept_layers` chooses (by the measured influence with
``keep="importance"``), is built from the teacher's weights read lazily
(:func:`zgcore.models.teacher_weights.layer_source`) and trains on the boundary store or, with
``targets="online"``, on the teacher's boundaries computed as it goes (:func:`train_block`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import torch

from zgcore.atomic import write_json
from zgcore.training.blocks import BlockTraining, aux_active, block_seed, save_weights, train_block
from zgcore.training.memory import PeakRSS

BLOCK, INIT, METRICS = "block.safetensors", "init.safetensors", "metrics.json"  # a trained block's files


@dataclass(frozen=True)
class PartitionJob:
    """What one partition's training reads, as its task resolved it.

    Attributes:
        teacher: the prepared teacher's record (``n_layers``, ``path`` absolute; ``tasks.teacher.teacher_record``).
        boundary, corpus, train: the experiment's boundary and corpus sections and this block's
            resolved train settings (plain mappings, as :func:`zgcore.config.experiment.resolve` gives them).
        block: the partition's index. device: the torch device it trains on.
        work: its work folder (checkpoints, logs). run_hash: the task's hash. name: its name in messages.
        cache: the boundary store's folder (cached targets), else ``None``.
        tokens: the token store's ``tokens.h5`` (online targets or local auxiliary terms), else ``None``.
        importance: ``importance.json`` of the teacher's measurements when the block needs them
            (:func:`zgcore.models.students.needs_measure`), else ``None``.
        flops: the training FLOPs of a block, ``flops(layer_params, width, seq_len, steps, batch_size)``
            (:func:`zgcore.evaluation.flops.block_train_flops`, handed down: training sits below
            evaluation in zgcore's layers).
        progress: ``progress(step, steps, loss)``.
        watchers: the run's callbacks given its training FLOPs per token (TensorBoard).
    """
    teacher: Mapping[str, Any]
    boundary: Mapping[str, Any]
    corpus: Mapping[str, Any]
    train: Mapping[str, Any]
    block: int
    device: str
    work: Path
    run_hash: str
    name: str
    flops: Callable[[Sequence[int], int, int, int, int], int]
    cache: Path | None = None
    tokens: Path | None = None
    importance: Path | None = None
    progress: Callable[[int, int, float], None] | None = None
    watchers: Callable[[float], Sequence[Callable]] = lambda per_token: ()


@dataclass
class TrainedPartition:
    """A trained block (:class:`~zgcore.models.adapters.StudentBlock`), its weights before training and
    its metrics; :meth:`save` writes them."""
    block: Any
    init_state: dict[str, torch.Tensor]
    metrics: dict[str, Any]
    rss: PeakRSS

    def save(self, folder: Path) -> None:
        """Write ``block.safetensors``, ``init.safetensors`` and ``metrics.json`` (with the peak
        resident memory since the job started, MiB) into ``folder``."""
        save_weights(folder / BLOCK, self.block.layer_state_dict())
        save_weights(folder / INIT, self.init_state)
        write_json(folder / METRICS, {**self.metrics, "peak_rss_mib": self.rss.stop()})


def mixer_of(t: Mapping[str, Any]) -> dict[str, Any]:
    """``{"mixer", "window"}`` of a converted block's train settings or metrics, ``{}`` for softmax
    (whose metrics stay as they were)."""
    from zgcore.models.mixers import WINDOWED, is_converted

    if not is_converted(t):
        return {}
    return {"mixer": t["mixer"], **({"window": int(t["window"])} if t["mixer"] in WINDOWED else {})}


def train_partition(job: PartitionJob) -> TrainedPartition:
    """Build partition ``job.block``'s student block and train it (:func:`train_block`).

    Returns:
        The block, its initial weights and its metrics: :func:`train_block`'s, ``teacher_seconds``
        (the teacher's time with online targets, s), the utilisation against this process's matmul peak
        (:func:`zgcore.training.mfu.utilisation`), and the block's shape (``block``, ``start``, ``end``,
        ``kept``, ``objective``, ``targets``, ``seed``, ``keep``, ``intermediate_size``, ``kv_heads``
        when set, ``mixer``/``window`` when converted, ``influence`` when measured).

    Raises:
        As :func:`train_block` (NonFiniteError, BoundaryStoreError, ValueError).
    """
    from zgcore.device import resolve
    from zgcore.models.adapters import build_block, head_logits
    from zgcore.models.shapes import kept_layers, resolve_boundaries
    from zgcore.models.teacher_weights import layer_source, load_head
    from zgcore.training import mfu

    rss = PeakRSS().start()  # the job's peak resident memory (the distillation study reports it)
    t, rec = job.train, job.teacher
    bs = resolve_boundaries(job.boundary, rec["n_layers"])
    start, end = bs[job.block], bs[job.block + 1]
    measured = json.loads(Path(job.importance).read_text()) if job.importance else {}
    kept = kept_layers(start, end, t, measured.get("influence"))
    seed = block_seed(int(t["seed"]), job.block)
    # the teacher's config and only the kept layers' weights, read lazily (safetensors)
    block = build_block(layer_source(rec), kept, t["init"], seed, device=resolve(job.device),
                        intermediate_size=t.get("intermediate_size"), channels=measured.get("channels"),
                        kv_heads=t.get("kv_heads"), **mixer_of(t))
    init_sd = {k: v.clone() for k, v in block.layer_state_dict().items()}  # training updates in place
    aux = aux_active(t)  # local auxiliary terms: the teacher's head and the token ids
    tokens = _train_tokens(job) if t["targets"] == "online" or aux else None
    head = load_head(rec, job.device) if aux else None  # embedding, final norm and LM head: no decoder layer
    source = _source(job, tokens, start, end)
    seq_len, width = int(job.corpus["seq_len"]), block.body.config.hidden_size
    layer_params = [sum(p.numel() for p in layer.parameters()) for layer in block.layers]
    per_token = job.flops(layer_params, width, seq_len, 1, 1) / seq_len  # training FLOPs per token
    run = BlockTraining(t, seed, job.work, job.run_hash, name=job.name, progress=job.progress,
                        head=(lambda h: head_logits(head, h)) if aux else None, tokens=tokens,
                        callbacks=job.watchers(per_token), transfer=_transfer(job, rec, block, start, end, kept))
    with source:
        m = train_block(block, source, start, end, run)
        m["teacher_seconds"] = getattr(source, "teacher_seconds", 0.0)
    # the block's training FLOPs against this process's matmul peak (the report's utilisation table)
    m.update(mfu.utilisation(job.flops(layer_params, width, seq_len, m["steps"], int(t["batch_size"])), m["seconds"],
                             job.device))
    m.update({"block": job.block, "start": start, "end": end, "kept": kept, "objective": t["objective"],
              "targets": t["targets"], "seed": seed, "keep": t["keep"], "intermediate_size": block.width,
              **({"kv_heads": block.kv_heads} if block.kv_heads is not None else {}), **mixer_of(t),
              "influence": [measured["influence"][i] for i in range(start, end)] if measured else None})
    return TrainedPartition(block, init_sd, m, rss)


def _train_tokens(job: PartitionJob):
    """The token store's train split ``[n_train, seq_len]``, in the boundary store's order."""
    from zgcore.data import corpus

    return corpus.read_tokens(job.tokens, "train")


def _source(job: PartitionJob, tokens, start: int, end: int):
    """Where the block's boundary pairs come from: the boundary store, or the teacher up to the block's
    output boundary, run on the train tokens (online targets)."""
    from zgcore.data import boundary_store
    from zgcore.data.boundary_store import codec
    from zgcore.models.teacher_stream import teacher_for

    if job.train["targets"] != "online":
        return boundary_store.BoundaryReader(job.cache)
    teacher = teacher_for(job.teacher, end, job.boundary["teacher_dtype"], job.device)  # whole, or streamed per batch
    return boundary_store.OnlineBoundaries(teacher, tokens, [start, end], job.boundary["dtype"],
                                           int(job.boundary["batch_size"]), codec.settings(job.boundary))


def _transfer(job: PartitionJob, rec, block, start: int, end: int, kept: Sequence[int]):
    """Objective ``attention_transfer``: the block's input -> its loss against the partition's own
    teacher layers (read lazily); ``None`` for every other objective."""
    if job.train["objective"] != "attention_transfer":
        return None
    from zgcore.device import resolve
    from zgcore.models.adapters import build_block
    from zgcore.models.teacher_weights import layer_source
    from zgcore.training.transfer import AttentionTargets, transfer_loss

    targets = AttentionTargets(build_block(layer_source(rec), list(range(start, end)), "teacher", 0,
                                           device=resolve(job.device)), start, kept)
    return lambda x: transfer_loss(block, targets, x)
