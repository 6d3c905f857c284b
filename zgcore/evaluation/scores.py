"""Per-sequence held-out scores of an evaluation, as they are stored beside its summary
(:data:`SCORES`), and the check that two evaluations scored the same sequences.

Every evaluation writes each model's per-sequence mean next-token CE (nats/token) with the rows it
scored and, where the corpus records them, each row's document id, so any later comparison
(:mod:`zgcore.evaluation.compare`) can pair the arms sequence by sequence and resample whole
documents.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

import numpy as np

SCORES = "per_sequence_ce.json"  # every evaluation's per-sequence CE (nats/token), beside its summary


def subset_digest(indices: np.ndarray) -> str:
    """SHA-256 (hex) of held-out row indices as little-endian int64: names the exact sequences an
    evaluation scored, so two arms can be checked to have scored the same ones."""
    return hashlib.sha256(np.ascontiguousarray(indices, dtype="<i8").tobytes()).hexdigest()


def scores_part(scores: Mapping[str, np.ndarray], indices: np.ndarray, documents: np.ndarray | None = None) -> dict[str, Any]:
    """Per-sequence CE of the models scored on one held-out set, as JSON-ready lists.

    Args:
        scores: model key -> ``[n]`` per-sequence mean CE (nats/token), every array as long as ``indices``.
        indices: ``[n]`` int rows of the held-out set that were scored, in scoring order.
        documents: ``[n]`` int document id of each scored row (the corpus's, where it records them), or None.

    Returns:
        ``{"rows": [n ints], "subset_sha256", "sequences", "ce": {key: [n floats]}}`` and, with
        ``documents``, ``"documents": [n ints]``.

    Raises:
        ValueError: an array of another length than ``indices`` or with a non-finite value.
    """
    out = {"rows": [int(i) for i in indices], "subset_sha256": subset_digest(np.asarray(indices)),
           "sequences": int(len(indices)), "ce": {}}
    if documents is not None:
        if len(documents) != len(indices):
            raise ValueError(f"{len(documents)} document ids for {len(indices)} scored rows")
        out["documents"] = [int(x) for x in documents]
    for k, v in scores.items():
        v = np.asarray(v, dtype=np.float64)
        if v.shape != (len(indices),) or not np.isfinite(v).all():
            raise ValueError(f"per-sequence CE of {k!r}: shape {v.shape} (expected ({len(indices)},)) or a non-finite value")
        out["ce"][k] = [float(x) for x in v]
    return out


def save_scores(path: str | os.PathLike, val: Mapping[str, Any], extra: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Write an evaluation's per-sequence CE to ``path`` (JSON, :data:`SCORES`): ``{"val": part,
    "extra": {corpus name: part}}`` with parts from :func:`scores_part` (the held-out split, then
    every ``eval.extra`` corpus)."""
    Path(path).write_text(json.dumps({"val": dict(val), "extra": dict(extra or {})}, sort_keys=True) + "\n")


def load_scores(path: str | os.PathLike) -> dict[str, Any]:
    """Read a :func:`save_scores` file, every ``ce`` list as a float64 ``np.ndarray`` (and
    ``documents``, where recorded, as int64)."""
    d = json.loads(Path(path).read_text())
    for part in [d["val"], *d.get("extra", {}).values()]:
        part["ce"] = {k: np.asarray(v, dtype=np.float64) for k, v in part["ce"].items()}
        if part.get("documents") is not None:
            part["documents"] = np.asarray(part["documents"], dtype=np.int64)
    return d


def check_same_sequences(digests: Sequence[str], what: str = "arms") -> None:
    """Raise ``RuntimeError`` unless every evaluation scored the same held-out rows (equal
    :func:`subset_digest`): a paired comparison on different sequences would be meaningless."""
    if len(set(digests)) > 1:
        raise RuntimeError(f"the {what} were scored on different held-out sequences ({len(set(digests))} distinct "
                           "subsets); rerun their evaluations with the same eval.max_sequences and eval.subset_seed")
