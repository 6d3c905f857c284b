"""A study's seeds: what a seed varies (the whole run's randomness), the cells once per seed, and
the seeds that search learning rates apart from those that are reported (no selection bias).
"""
from __future__ import annotations

import copy
from typing import Any
from collections.abc import Mapping

from zgcore.checks import ConfigError
from .config import expand_study


def validate_seeds(cfg: Mapping[str, Any]) -> None:
    """Check ``study.search_seeds`` and ``study.flops_matched`` against ``seeds`` and ``study.lrs``.

    Raises:
        ConfigError: search seeds that are not distinct non-negative integers, that overlap
            ``seeds`` (a search run must never be a reported run), or without an lr search or
            without ``seeds``; ``flops_matched`` not true or false."""
    st = cfg["study"]
    ss = st.get("search_seeds") or []
    if not isinstance(ss, (list, tuple)) or len(set(ss)) != len(ss) or any(
            isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in ss):
        raise ConfigError(f"study.search_seeds must be a list of distinct non-negative integers, got {ss!r}")
    if ss and not st.get("lrs"):
        raise ConfigError("study.search_seeds needs an lr search (study.lrs)")
    if ss and not cfg.get("seeds"):
        raise ConfigError("study.search_seeds needs the reported seeds (seeds = [...]), none of them a search seed")
    if set(ss) & set(cfg.get("seeds") or []):
        raise ConfigError(f"study.search_seeds {list(ss)} overlap seeds {list(cfg['seeds'])}: a search run must not be a "
                          "reported run (its selection would bias the reported CE); use other seeds")
    if not isinstance(st.get("flops_matched", False), bool):
        raise ConfigError(f"study.flops_matched must be true or false, got {st['flops_matched']!r}")


def seeded(run: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """``run`` with its whole randomness set by ``seed``: ``train.seed`` (model and aux-head
    initialisation) and ``train.data_seed`` (batch order and the tuning split)."""
    run = copy.deepcopy(dict(run))
    run["train"] = {**run["train"], "seed": int(seed), "data_seed": int(seed)}
    return run


SEED_VARIES = ("the whole run's randomness: model and aux-head initialisation (train.seed), the batch order and "
               "the tuning split (train.data_seed); every configuration of one seed sees the same tokens in the same "
               "order, the test sequences are the same for every run")


def expand_seeds(cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The study's cells (:func:`expand_study`, with :func:`.flops.flops_matched_cell` when
    ``study.flops_matched``) once per seed of ``cfg["seeds"]`` (seed-major), each with ``"seed"``
    and its run :func:`seeded` (:data:`SEED_VARIES`); without ``seeds`` the cells of ``train.seed``
    (and ``train.data_seed`` as configured)."""
    cells = expand_study(cfg)
    if cfg["study"].get("flops_matched"):
        from .flops import flops_matched_cell

        cells.append(flops_matched_cell(cfg, cells))
    if not cfg.get("seeds"):
        return [{**c, "seed": int(c["run"]["train"]["seed"])} for c in cells]
    return [{**c, "seed": int(s), "run": seeded(c["run"], s)} for s in cfg["seeds"] for c in cells]
