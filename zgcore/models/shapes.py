"""The shape of a student: the boundary layers that cut the teacher into partitions, which teacher
layers a partition's student block keeps, and the one-MLP-width rule of a whole student.

Plain arithmetic on a configuration's values (no torch); :mod:`zgcore.config.experiment` checks a
configuration with it, and the tasks, training and benchmarks call it to build students.
Source: ZeroGraph (arXiv:2611.02200), student initialisation from kept teacher layers.
"""
from __future__ import annotations

from typing import Any
from collections.abc import Mapping

from zgcore.checks import ConfigError


def resolve_boundaries(boundary: Mapping[str, Any], n_layers: int) -> list[int]:
    """The boundary layer indices b0=0 < ... < bK=n_layers for a teacher of ``n_layers`` layers.

    Raises:
        ConfigError: boundaries out of range, not ending at ``n_layers``, or more blocks than layers.
    """
    if boundary["boundaries"] is not None:
        bs = [int(x) for x in boundary["boundaries"]]
        if bs[-1] != n_layers:
            raise ConfigError(f"boundary.boundaries must end at the teacher's layer count {n_layers}, got {bs} "
                              f"(values must lie in 0..{n_layers})")
        return bs
    k = int(boundary["num_blocks"])
    if k > n_layers:
        raise ConfigError(f"boundary.num_blocks={k} exceeds the teacher's {n_layers} layers")
    return [round(j * n_layers / k) for j in range(k + 1)]


def n_kept(start: int, end: int, t: Mapping[str, Any]) -> int:
    """How many teacher layers of ``[start, end)`` the block's student keeps (raises
    :class:`ConfigError` when that is more than the partition has)."""
    size = end - start
    n = int(t["n_layers"]) if t["n_layers"] is not None else max(1, round(float(t["keep_fraction"]) * size))
    if n > size:
        raise ConfigError(f"n_layers={n} exceeds the partition's {size} teacher layers [{start}, {end})")
    return n


def kept_layers(start: int, end: int, t: Mapping[str, Any], influence: list[float] | None = None) -> list[int]:
    """Teacher layer indices in ``[start, end)`` that block's student starts from.

    ``keep="spread"`` keeps evenly spaced layers including the first and last of the partition
    (dropping layers from the middle hurts least on SmolLM2: held-out CE 3.89 for 24 of 30 layers
    vs 9.2 for dropping the last two of every ten); ``"first"``/``"last"`` keep a prefix/suffix;
    ``"importance"`` keeps the layers of largest block influence (``influence``: one value per
    teacher layer, :func:`zgcore.models.students.measure`).

    Raises:
        ConfigError: more student layers than the partition has. ValueError: ``"importance"``
            without ``influence``.
    """
    size, n = end - start, n_kept(start, end, t)
    if t["keep"] == "importance":  # the n largest, in layer order (ties: the earlier layer)
        if influence is None:
            raise ValueError("keep='importance' needs the teacher's measured layer influence")
        return sorted(sorted(range(start, end), key=lambda i: (-influence[i], i))[:n])
    if t["keep"] == "first":
        idx = list(range(n))
    elif t["keep"] == "last":
        idx = list(range(size - n, size))
    elif n == 1:
        idx = [0]
    else:
        idx = sorted({round(j * (size - 1) / (n - 1)) for j in range(n)})
    return [start + j for j in idx]


def check_one_width(blocks) -> None:
    """End-to-end distillation trains one whole student, and Hugging Face configs have one
    ``intermediate_size``: blocks of different MLP widths would leave zero-padded channels that
    training would grow, so it would not be the blockwise arm's student. Raises :class:`ConfigError`."""
    widths = {t.get("intermediate_size") for t in blocks}
    if len(widths) > 1:
        raise ConfigError("the end-to-end arm trains one student with one MLP width: set one "
                          f"train.intermediate_size for every block (got {sorted(map(str, widths))})")


def teacher_copies(bounds: list[int], trains: list[Mapping[str, Any]], mlp_width: int | None = None) -> list[int]:
    """The blocks whose student starts as its partition's teacher layers unchanged: every layer kept
    (:func:`n_kept`), ``init="teacher"``, the teacher's attention (``mixer="softmax"``), MLP width
    (``intermediate_size`` None or ``mlp_width``) and key-value heads. Such a block regresses the
    teacher onto itself (a clean-target loss of 0 from the first step); ``bounds``: the boundaries
    (:func:`resolve_boundaries`), ``trains``: each block's train settings."""
    return [i for i, t in enumerate(trains)
            if n_kept(bounds[i], bounds[i + 1], t) == bounds[i + 1] - bounds[i] and t.get("init") == "teacher"
            and t.get("mixer", "softmax") == "softmax" and t.get("intermediate_size") in (None, mlp_width)
            and t.get("kv_heads") is None]
