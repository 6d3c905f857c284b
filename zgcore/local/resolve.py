"""Resolving a local-learning study's configuration: defaults < preset < file < overrides, then
every check (:mod:`.config`, :mod:`.seeds`), before any task runs.
"""
from __future__ import annotations

import os
from typing import Any
from collections.abc import Mapping

from zgcore.config.experiment import (ConfigError, _check_keys, canonical_paths, deep_merge, load_file, parse_overrides,
                                      validate_corpus)
from zgcore.config.fields import check_section
from .config import LOCAL_DEFAULTS, validate_local, validate_model, validate_sweep, validate_train
from .schema import LocalEval, LocalStudy, Study
from .seeds import expand_seeds, validate_seeds


def resolve_local(file: str | os.PathLike | None = None, overrides: str | Mapping | None = None,
                  base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Build a full local-learning study config: ``LOCAL_DEFAULTS`` < ``base`` (a preset) < file <
    overrides (``"local.K=2 model.n_layers=4"``), then validate everything, including every
    configuration the study expands to.

    Raises:
        ConfigError: any unknown key or bad value, with what to fix.
    """
    cfg = deep_merge(LOCAL_DEFAULTS, base or {})
    if file:
        cfg = deep_merge(cfg, load_file(file))
    if overrides:
        cfg = deep_merge(cfg, parse_overrides(overrides) if isinstance(overrides, str) else overrides)
    _check_keys("local-learning study", cfg, LocalStudy)
    sections = ("corpus", "model", "train", "local", "study", "eval")
    for sec in sections:
        if not isinstance(cfg[sec], Mapping):
            raise ConfigError(f"`{sec}` must be a mapping")
    _check_keys("corpus", cfg["corpus"], LOCAL_DEFAULTS["corpus"])
    check_section(LocalStudy, {k: v for k, v in cfg.items() if k not in sections}, "")
    canonical_paths(cfg, "tokenizer")
    validate_corpus(cfg["corpus"])
    validate_model(cfg["model"])
    validate_train(cfg["train"], int(cfg["corpus"]["seq_len"]))
    check_section(Study, cfg["study"], "study")
    check_section(LocalEval, cfg["eval"], "eval")
    seeds = cfg["seeds"]
    if seeds is not None and (not seeds or len(set(seeds)) != len(seeds)):
        raise ConfigError(f"seeds must be a non-empty list of distinct non-negative integers, got {seeds!r}")
    validate_local(cfg["local"], cfg["model"]["n_layers"])
    validate_sweep(cfg["study"], cfg["train"], int(cfg["corpus"]["seq_len"]))
    validate_seeds(cfg)
    expand_seeds(cfg)  # validates every configuration of the sweep (and sizes the FLOPs-matched arm)
    return cfg
