"""Settings of end-to-end distillation (the ``heal`` section of an experiment, and the distillation
study's end-to-end arm): the checks that relate their keys, and what their hash covers. The settings
themselves are declared in :mod:`zgcore.config.schema` (:class:`~zgcore.config.schema.Heal`,
:class:`~zgcore.config.schema.Distill`). Kept free of torch so that :mod:`zgcore.config.experiment` can
import it; the training itself is :mod:`zgcore.training.distill`."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zgcore.checks import ConfigError
from zgcore.config.fields import check_section, hashed_view
from zgcore.config.schema import Distill, Heal


def validate_distill(h: Mapping[str, Any], where: str = "heal") -> None:
    """Check a distillation section (``heal`` or ``distill``) against its declarations and the rules between
    its keys. Raises :class:`ConfigError`."""
    check_section(Distill if where == "distill" else Heal, h, where)
    if h["targets"] == "cached" and not int(h["top_k"]):
        raise ConfigError(f"{where}.targets=cached reads top-k targets: set {where}.top_k = 64 (the measured "
                          "choice, docs/topk-distillation.md) or another k > 0; the full vocabulary (top_k = 0) "
                          "is online only")
    if h["targets"] == "cached" and float(h["hidden_weight"]) > 0:
        raise ConfigError(f"{where}.targets=cached reads only the teacher's logits: set {where}.hidden_weight=0 "
                          f"or {where}.targets=online (the hidden-state term needs the teacher's residual stream)")
    if h.get("lrs") and len({float(x) for x in h["lrs"]}) != len(h["lrs"]):
        raise ConfigError(f"{where}.lrs repeats a learning rate: {list(h['lrs'])!r}")


def distill_hashed(d: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of an end-to-end distillation a result depends on, as their declarations say
    (:class:`zgcore.config.schema.Distill`): not ``checkpoint_every``, ``log_every`` or ``tensorboard``; not
    ``top_k`` when 0 nor ``targets`` when ``"online"`` (the defaults: runs from before they existed keep their
    hashes); without a search (``lrs`` empty or absent) not ``lrs``/``lr_rounds``; with one not ``lr`` (the
    search chooses it). Serves the ``heal`` section too (it has no ``lrs``)."""
    return hashed_view(Distill, d)
