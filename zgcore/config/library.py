"""The ``[library]`` section: candidate block shapes tried at every partition (or per partition),
the budgets a student is chosen under, and the arithmetic that turns them into block train
settings, costs and budgets before anything runs.

A variant is a table of at most these keys, each replacing the block's train setting of that name
(keys left out keep the block's own value, so a variant ``{}`` is the experiment's own block):

* ``n_layers`` (int) or ``keep_fraction`` (float in (0, 1]): how many teacher layers the block keeps;
* ``keep``: which (``spread``, ``importance``, ``first``, ``last``);
* ``mlp``: MLP width as a fraction of the teacher's (1 = the teacher's width: ``intermediate_size`` None);
* ``kv_heads``: key-value heads (the teacher's count = None; fewer: grouped-query conversion);
* ``mixer``: the token mixer (``softmax``, ``window``, ``linear``, ``linear_window``, ``none``:
  :mod:`zgcore.models.mixers`), so a ``kv_bytes`` budget at ``library.context`` tokens chooses
  which partitions keep softmax attention.

A candidate's train settings are exactly what an experiment asking for the same block resolves to,
so the two share one ``TrainBlock`` (one hash, trained once).
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from zgcore.checks import ConfigError
from zgcore.config.fields import check_section
from zgcore.config.schema import Library, Variant

VARIANT_KEYS = tuple(Variant.model_fields)  # declared in zgcore.config.schema.Variant


def active(cfg: Mapping[str, Any]) -> bool:
    """Whether the configuration defines a library (variants at every or at some partition)."""
    lib = cfg.get("library") or {}
    return bool(lib.get("variants")) or bool(lib.get("blocks"))


def validate(cfg: dict[str, Any]) -> None:
    """Check the ``library`` section against its declarations (:class:`zgcore.config.schema.Library`,
    teacher-independent) and normalise ``library.blocks``' keys to strings. Raises :class:`ConfigError`
    naming the key to fix."""
    lib = cfg["library"]
    blocks = lib.get("blocks") or {}
    if not isinstance(blocks, Mapping):
        raise ConfigError("library.blocks must map a partition index to {variants = [...]}")
    norm = {}
    for k, v in blocks.items():
        if not str(k).isdigit() or not isinstance(v, Mapping) or set(v) - {"variants"}:
            raise ConfigError(f"library.blocks.{k}: give library.blocks.<partition>.variants = [...]")
        norm[str(int(k))] = {"variants": v.get("variants") or []}
    lib["blocks"] = norm
    check_section(Library, lib, "library")
    for where, variants in [("library.variants", lib["variants"])] + [(f"library.blocks.{k}.variants", v["variants"])
                                                                       for k, v in norm.items()]:
        for j, v in enumerate(variants):
            if "n_layers" in v and "keep_fraction" in v:
                raise ConfigError(f"{where}[{j}]: give n_layers or keep_fraction, not both")
    for v in norm.values():
        v["variants"] = list(v["variants"])


def converted(t: Mapping[str, Any]) -> bool:
    """Whether a candidate's train settings ask for a token mixer other than softmax."""
    return t.get("mixer", "softmax") != "softmax"


def partition_variants(cfg: Mapping[str, Any], i: int) -> list[dict[str, Any]]:
    """Partition ``i``'s variants: ``library.blocks.<i>.variants`` when given, else ``library.variants``."""
    lib = cfg["library"]
    own = (lib.get("blocks") or {}).get(str(i))
    return [dict(v) for v in (own["variants"] if own else lib["variants"])]


def candidate_train(block_train: Mapping[str, Any], variant: Mapping[str, Any], mlp_width: int,
                    teacher_kv: int | None) -> dict[str, Any]:
    """The train settings of one candidate: the block's resolved settings with the variant's keys.

    Args:
        block_train: the partition's resolved train settings (``train`` merged with ``blocks.<i>``).
        variant: one variant table. mlp_width: the teacher's MLP width (channels).
        teacher_kv: the teacher's key-value heads (``kv_heads`` equal to it becomes None, the
            experiment's default, so both name one block).
    """
    t = copy.deepcopy(dict(block_train))
    if "n_layers" in variant:
        t["n_layers"] = int(variant["n_layers"])
    if "keep_fraction" in variant:
        t["n_layers"], t["keep_fraction"] = None, float(variant["keep_fraction"])
    if "keep" in variant:
        t["keep"] = variant["keep"]
    if "mlp" in variant:
        w = max(1, round(float(variant["mlp"]) * mlp_width))
        t["intermediate_size"] = None if w == mlp_width else int(w)
    if "kv_heads" in variant:
        t["kv_heads"] = None if teacher_kv is not None and int(variant["kv_heads"]) == teacher_kv else int(variant["kv_heads"])
    if "mixer" in variant:
        t["mixer"] = variant["mixer"]
    return t


def describe_variant(t: Mapping[str, Any], kept: int, mlp_width: int, teacher_kv: int) -> str:
    """A short name of a candidate from its train settings ``t`` and its kept-layer count, e.g.
    ``8L spread mlp75% kv1`` (MLP width as a share of the teacher's; ``kv`` only when reduced; the
    mixer only when not softmax)."""
    width = t.get("intermediate_size") or mlp_width
    kv = f" kv{t['kv_heads']}" if t.get("kv_heads") not in (None, teacher_kv) else ""
    mixer = f" {t['mixer']}" if t.get("mixer", "softmax") != "softmax" else ""
    return f"{kept}L {t['keep']} mlp{100 * width / mlp_width:.0f}%{kv}{mixer}"


def budgets(lib: Mapping[str, Any], teacher_cost: float) -> list[float]:
    """``library.budgets`` in the unit's absolute terms: each value <= 1 is a fraction of the
    teacher's cost ``teacher_cost`` (same unit), larger values are taken as they are."""
    return [float(b) * teacher_cost if float(b) <= 1 else float(b) for b in lib["budgets"]]
