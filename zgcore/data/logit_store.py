"""The top-k logit store: the teacher's output distribution at every token, compressed to its
top ``k`` tokens and the mass outside them, as a build artefact built, checked and read by the
boundary store's own machinery (:mod:`zgcore.data.boundary_store`: the same shard writer, join,
manifest, reader, checksums, finiteness checks and quarantine; the same prefetching input
pipeline, :func:`zgcore.data.feed.block_batches`).

**Targets** (per position, teacher logits ``z``, temperature ``T``, ``p = softmax(z / T)``): the
ids ``K`` of the ``k`` largest logits (``torch.topk`` order: most probable first), their
log-probabilities ``log p_i`` (float32) and the log of the mass outside them,
``log p_R = log sum_{j not in K} p_j`` — a log-sum-exp over the complement, not
``log(1 - sum p_i)``, which loses every digit when the top k hold almost all the mass; floored
at :data:`REST_FLOOR`, below which the tail counts as empty. The loss that uses them is
:mod:`zgcore.training.topk`.

**Record and storage precision.** One float32 array ``[..., 2k + 1]`` per position: columns
``0 .. k-1`` hold the ids' int32 bytes (viewed as float32: every id below 2**23 reads as a
subnormal, so finite, value and is never computed with), ``k .. 2k-1`` the log-probabilities
in float32, ``2k`` the tail's log-mass in float32: ``8k + 4`` bytes per token (68 at k = 8, 516
at k = 64), plus 8 bytes of xxh3 per sequence. Float32, not bfloat16, for the log-probabilities:
bfloat16 keeps 8 significant bits, an error of up to ~0.04 nats on a log-probability of -10,
larger than the differences a top-k study resolves; at k = 64 the ids take half the bytes anyway.

**Layout.** A logit store is a boundary store whose one "boundary" :data:`LOGITS` (file
``b0.h5``) holds the records ``[rows, seq_len, 2k + 1]`` (its manifest's ``hidden_size`` is
``2k + 1``) and whose manifest says ``kind = "topk-logits"``, ``top_k`` and ``temperature``.
Store and online targets are the same bits (:func:`online_targets`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .boundary_store import BoundaryReader, BoundaryStoreError, write_shard

KIND = "topk-logits"
LOGITS = 0  # the store's one pseudo-boundary: file b0.h5, dataset h [rows, seq_len, 2k + 1]

# log-mass of the tail below which it counts as none (exp(-1e4) is 0 in float32 and float64)
REST_FLOOR = -1.0e4
# the largest id whose int32 bytes read as a finite float32 (exponent bits not all ones)
MAX_ID = (0x7F800000 - 1)


def record_width(k: int) -> int:
    """Float32 columns of one position's record: ``2k + 1``."""
    return 2 * int(k) + 1


def bytes_per_token(k: int) -> int:
    """Bytes stored per token for top-``k`` targets (float32 record, HDF5 and checksums excluded)."""
    return 4 * record_width(k)


def teacher_targets(logits: torch.Tensor, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``k`` targets from the teacher's logits.

    Args:
        logits: ``[..., vocab]`` (any float dtype; computed in float32). k: 1 <= k < vocab.
        temperature: ``T`` > 0.

    Returns:
        ``(ids, logp, rest)``: int64 ``[..., k]`` (most probable first), float32 ``[..., k]``
        (``log p_i`` at ``T``), float32 ``[...]`` (``log p_R``, floored at :data:`REST_FLOOR`),
        on the logits' device.

    Raises:
        ValueError: ``k`` outside ``1 .. vocab - 1``, or a vocabulary whose ids cannot be stored
            (above :data:`MAX_ID` + 1 tokens). Judged from shapes: nothing is read back from the device.
    """
    v = logits.shape[-1]
    if not 1 <= int(k) < v:
        raise ValueError(f"top_k must be in 1..{v - 1} (the vocabulary has {v} tokens), got {k}")
    if v - 1 > MAX_ID:
        raise ValueError(f"token ids must lie in 0..{MAX_ID} to be stored; the vocabulary has {v} tokens")
    z = logits.float() / temperature
    lse = torch.logsumexp(z, -1)
    vals, ids = torch.topk(z, int(k), -1)
    rest = torch.logsumexp(z.scatter(-1, ids, float("-inf")), -1) - lse
    return ids, vals - lse.unsqueeze(-1), rest.clamp_min(REST_FLOOR)


def pack(ids: torch.Tensor, logp: torch.Tensor, rest: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """The record of :func:`teacher_targets`' output: float32 ``[..., 2k + 1]`` (see the module).

    ``vocab``: the size of the vocabulary the ids index (what :func:`teacher_targets` gives: ids
    below it by construction): checked against :data:`MAX_ID` from the number alone, so packing
    ids on a device never waits for it. Without it the ids themselves are checked, which reads two
    values back from their device. Raises ``ValueError`` for an id outside ``0 .. MAX_ID``."""
    if vocab is not None:
        if int(vocab) - 1 > MAX_ID:
            raise ValueError(f"token ids must lie in 0..{MAX_ID} to be stored; the vocabulary has {vocab} tokens")
    elif ids.numel() and (int(ids.min()) < 0 or int(ids.max()) > MAX_ID):
        raise ValueError(f"token ids must lie in 0..{MAX_ID} to be stored, got {int(ids.min())}..{int(ids.max())}")
    return torch.cat([ids.to(torch.int32).contiguous().view(torch.float32), logp.float(), rest.float().unsqueeze(-1)], -1)


def unpack(rec: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack` for a float32 record ``[..., 2k + 1]``: ``(ids int64 [..., k],
    logp float32 [..., k], rest float32 [...])``. Raises ``ValueError`` on another width."""
    if rec.shape[-1] != record_width(k):
        raise ValueError(f"a top-{k} record has {record_width(k)} columns, got {rec.shape[-1]}")
    ids = rec[..., :k].contiguous().view(torch.int32).long()
    return ids, rec[..., k: 2 * k], rec[..., 2 * k]


@torch.no_grad()
def online_targets(teacher: torch.nn.Module, ids: torch.Tensor, k: int, temperature: float) -> torch.Tensor:
    """The teacher's top-``k`` records (:func:`pack`) for token ids ``[B, S]`` (int64): float32
    ``[B, S, 2k + 1]`` on the teacher's device (nothing read back: the training step keeps them
    there; the store's writer copies them to the CPU). The teacher (a causal LM, eval) runs one
    sequence at a time (a matrix product's rounding may depend on how many rows it has), so the
    store and online targets agree bitwise. Raises ``ValueError`` for ``k`` outside ``1 .. vocab - 1``."""
    out = []
    for i in range(ids.shape[0]):
        logits = teacher(input_ids=ids[i: i + 1], use_cache=False).logits
        out.append(pack(*teacher_targets(logits, k, temperature), vocab=logits.shape[-1]))
    return torch.cat(out)


def store_extra(top_k: int, temperature: float) -> dict[str, Any]:
    """The manifest entries that make a boundary store a top-``k`` logit store (every shard carries them)."""
    return {"kind": KIND, "top_k": int(top_k), "temperature": float(temperature)}


def write_logit_shard(folder: str | Path, teacher: torch.nn.Module, rows: np.ndarray, split: str, lo: int, k: int,
                      temperature: float, batch_size: int, extra: Mapping[str, Any],
                      progress: Callable[[int, int], None] | None = None,
                      peak_rss: Callable[[], float | None] | None = None, desc: str | None = None) -> dict[str, Any]:
    """Write one logit shard into ``folder`` (which must exist): the teacher's top-``k`` records of
    ``rows`` (token ids ``[m, seq_len]``, sequences ``lo .. lo + m - 1`` of ``split``), through
    :func:`zgcore.data.boundary_store.write_shard` (its file, xxh3 per sequence, SHA-256 in
    ``shard.json``, finiteness check, a progress bar named ``desc``). ``teacher``: a causal LM
    (eval), the one online targets run.

    Returns the shard record. Raises :class:`~zgcore.data.boundary_store.BoundaryStoreError` on a
    non-finite target, ``ValueError`` for a bad ``k``."""
    return write_shard(folder, teacher, rows, split, lo, [LOGITS], "float32", batch_size,
                       {**extra, **store_extra(k, temperature)}, progress=progress, peak_rss=peak_rss, desc=desc,
                       capture=lambda ids: {LOGITS: online_targets(teacher, ids, k, temperature).cpu()}, width=record_width(k))


def open_store(path: str | Path, k: int, temperature: float, expect: Mapping[str, Any] | None = None,
               pin_memory: bool = False) -> BoundaryReader:
    """A :class:`~zgcore.data.boundary_store.BoundaryReader` over a logit store's join folder,
    checked to hold top-``k`` records at ``temperature`` (and ``expect``'s manifest entries).
    ``reader.read(split, LOGITS, idx)`` gives float32 records ``[len(idx), seq_len, 2k + 1]``
    (:func:`unpack` them). Raises :class:`~zgcore.data.boundary_store.BoundaryStoreError`."""
    r = BoundaryReader(path, expect={**(expect or {}), **store_extra(k, temperature)}, pin_memory=pin_memory)
    if int(r.manifest["hidden_size"]) != record_width(k):
        r.close()
        raise BoundaryStoreError(f"{r.root}: records of width {r.manifest['hidden_size']}, not {record_width(k)} (top {k})")
    return r
