"""The registry of training paths: every way the code trains something on the one training loop
(ZeroGraph blocks, healing, end-to-end distillation online, cached and top-k, local learning in
each execution mode) registers itself here, with a seconds-long run of itself on a tiny random
teacher. The house's rules for training are contract tests over this registry
(``tests/test_contract_training.py``): at most one host read-back per ``log_every`` window, a NaN
between read-backs fails before any checkpoint is written, every batch reaches the device through
:func:`zgcore.device.to_device`. A new path (a new mixer, a pipelined local trainer) joins the
contracts by registering; a module that builds a :class:`~zgcore.training.loop.TrainLoop` without
registering a path fails them by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping

# what every smoke run accepts and obeys, besides its own settings
SMOKE_KEYS = ("max_steps", "log_every", "checkpoint_every")


@dataclass(frozen=True)
class TrainingPath:
    """One registered training path.

    Attributes:
        name: unique, e.g. ``"distill/top-k cached"``.
        module: the module whose code builds the path's :class:`~zgcore.training.loop.TrainLoop`.
        smoke: ``smoke(folder, settings)`` trains the path from scratch on a tiny random teacher
            built under ``folder`` (also its work folder: checkpoints land in ``folder / "work"``)
            for ``settings["max_steps"]`` steps, reading back every ``settings["log_every"]`` steps
            and checkpointing every ``settings["checkpoint_every"]`` (0: never); returns the
            path's metrics. Seconds on a CPU.
    """

    name: str
    module: str
    smoke: Callable[[Path, Mapping[str, Any]], Any]


PATHS: dict[str, TrainingPath] = {}


def register_path(name: str, module: str, smoke: Callable[[Path, Mapping[str, Any]], Any]) -> TrainingPath:
    """Add a training path to :data:`PATHS` (call it at the import of the path's module); returns it.
    Raises ``ValueError`` when another module already registered ``name``."""
    old = PATHS.get(name)
    if old is not None and old.module != module:
        raise ValueError(f"training path {name!r} is registered by {old.module} already")
    PATHS[name] = path = TrainingPath(name, module, smoke)
    return path


def smoke_settings(base: Mapping[str, Any], settings: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` train settings with the smoke run's :data:`SMOKE_KEYS` from ``settings``."""
    return {**base, **{k: settings[k] for k in SMOKE_KEYS if k in settings}}


def tiny_teacher(folder: Path, family: str = "tiny-llama"):
    """A tiny random causal LM (float32, eval, CPU) built under ``folder``: what a smoke run trains against."""
    from zgcore.models.teacher import load, materialise

    model, _ = load(materialise(family, outputs=folder, log=lambda m: None))
    return model.eval()
