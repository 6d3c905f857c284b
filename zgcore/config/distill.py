"""Settings of end-to-end distillation (the ``heal`` section of an experiment, and the distillation
study's end-to-end arm): validation. Their defaults are data in :mod:`zgcore.config.defaults`
(``HEAL_DEFAULTS``, ``DISTILL_DEFAULTS``). Kept free of torch so that :mod:`zgcore.config.experiment` can
import it; the training itself is :mod:`zgcore.training.distill`."""
from __future__ import annotations

import math
from typing import Any, Mapping

from zgcore.checks import ConfigError, positive_int, validate_lr_search


def validate_distill(h: Mapping[str, Any], where: str = "heal") -> None:
    """Check a distillation section (``heal`` or ``distill``). Raises :class:`ConfigError`."""
    positive_int(f"{where}.steps", h["steps"], zero_ok=True)
    for k in ("lr", "temperature"):
        v = h[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise ConfigError(f"{where}.{k} must be a finite number > 0, got {v!r}")
    notes = {"hidden_weight": " (0 = logits only)", "grad_clip": " (0 = no clipping)", "weight_decay": ""}
    for k, note in notes.items():
        v = h[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
            raise ConfigError(f"{where}.{k} must be a finite number >= 0{note}, got {v!r}")
    for k in ("batch_size", "checkpoint_every", "log_every"):
        positive_int(f"{where}.{k}", h[k])
    for k in ("warmup_steps", "seed"):
        positive_int(f"{where}.{k}", h[k], zero_ok=True)
    positive_int(f"{where}.top_k", h["top_k"], zero_ok=True)
    if h["targets"] not in ("online", "cached"):
        raise ConfigError(f"{where}.targets must be \"online\" or \"cached\", got {h['targets']!r}")
    if h["targets"] == "cached" and not int(h["top_k"]):
        raise ConfigError(f"{where}.targets=cached reads top-k targets: set {where}.top_k = 64 (the measured "
                          "choice, docs/topk-distillation.md) or another k > 0; the full vocabulary (top_k = 0) "
                          "is online only")
    if h["targets"] == "cached" and float(h["hidden_weight"]) > 0:
        raise ConfigError(f"{where}.targets=cached reads only the teacher's logits: set {where}.hidden_weight=0 "
                          f"or {where}.targets=online (the hidden-state term needs the teacher's residual stream)")
    if not isinstance(h["tensorboard"], bool):
        raise ConfigError(f"{where}.tensorboard must be true or false, got {h['tensorboard']!r}")
    if "lrs" in h:
        validate_lr_search(where, h["lrs"], h["lr_rounds"])


def distill_hashed(d: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of an end-to-end distillation a result depends on: not ``checkpoint_every``,
    ``log_every`` or ``tensorboard``; not ``top_k`` when 0 nor ``targets`` when ``"online"`` (the defaults: runs
    from before they existed keep their hashes; a cached run is a result of its own, with its own
    name, though byte-identical to the online top-k run);
    without a search (``lrs`` empty or absent) not ``lrs``/``lr_rounds`` (so arms without one keep
    their hashes); with one not ``lr`` (the search chooses it)."""
    out = {k: v for k, v in dict(d).items() if k not in ("checkpoint_every", "log_every", "tensorboard")}
    if not int(out.get("top_k") or 0):
        out.pop("top_k", None)
    if out.get("targets", "online") == "online":
        out.pop("targets", None)
    if out.get("lrs"):
        out.pop("lr", None)
    else:
        out.pop("lrs", None)
        out.pop("lr_rounds", None)
    return out
