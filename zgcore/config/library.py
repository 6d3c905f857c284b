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
from zgcore.models.costs import UNITS

VARIANT_KEYS = ("n_layers", "keep_fraction", "keep", "mlp", "kv_heads", "mixer")
MIXERS = ("softmax", "window", "linear", "linear_window", "none")  # zgcore.models.hf_converted_llama.MIXERS


def active(cfg: Mapping[str, Any]) -> bool:
    """Whether the configuration defines a library (variants at every or at some partition)."""
    lib = cfg.get("library") or {}
    return bool(lib.get("variants")) or bool(lib.get("blocks"))


def validate(cfg: dict[str, Any]) -> None:
    """Check the ``library`` section's form (teacher-independent) and normalise ``library.blocks``'
    keys to strings. Raises :class:`ConfigError` naming the key to fix."""
    lib = cfg["library"]
    if lib["budget_unit"] not in UNITS:
        raise ConfigError(f"library.budget_unit must be one of {', '.join(UNITS)}, got {lib['budget_unit']!r}")
    if not isinstance(lib["budgets"], (list, tuple)):
        raise ConfigError(f"library.budgets must be a list of numbers, got {lib['budgets']!r}")
    for j, b in enumerate(lib["budgets"]):
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not b > 0:
            raise ConfigError(f"library.budgets[{j}] must be a number > 0 (a fraction of the teacher's cost when <= 1), "
                              f"got {b!r}")
    blocks = lib.get("blocks") or {}
    if not isinstance(blocks, Mapping):
        raise ConfigError("library.blocks must map a partition index to {variants = [...]}")
    norm = {}
    for k, v in blocks.items():
        if not str(k).isdigit() or not isinstance(v, Mapping) or set(v) - {"variants"}:
            raise ConfigError(f"library.blocks.{k}: give library.blocks.<partition>.variants = [...]")
        norm[str(int(k))] = {"variants": list(v.get("variants") or [])}
    lib["blocks"] = norm
    if isinstance(lib.get("context"), bool) or not isinstance(lib.get("context"), int) or lib["context"] < 0:
        raise ConfigError(f"library.context must be a number of tokens >= 0 (0 = kv_bytes per token), got {lib.get('context')!r}")
    for where, variants in [("library.variants", lib["variants"])] + [(f"library.blocks.{k}.variants", v["variants"])
                                                                       for k, v in norm.items()]:
        if not isinstance(variants, (list, tuple)):
            raise ConfigError(f"{where} must be a list of tables")
        for j, v in enumerate(variants):
            _check_variant(v, f"{where}[{j}]")


def _check_variant(v: Any, where: str) -> None:
    if not isinstance(v, Mapping):
        raise ConfigError(f"{where} must be a table of {', '.join(VARIANT_KEYS)}")
    unknown = sorted(set(v) - set(VARIANT_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(VARIANT_KEYS)}")
    if "n_layers" in v and "keep_fraction" in v:
        raise ConfigError(f"{where}: give n_layers or keep_fraction, not both")
    if "n_layers" in v and (isinstance(v["n_layers"], bool) or not isinstance(v["n_layers"], int) or v["n_layers"] < 1):
        raise ConfigError(f"{where}.n_layers must be an integer >= 1, got {v['n_layers']!r}")
    for k in ("keep_fraction", "mlp"):
        if k in v and (isinstance(v[k], bool) or not isinstance(v[k], (int, float)) or not 0 < v[k] <= 1):
            raise ConfigError(f"{where}.{k} must be a number in (0, 1], got {v[k]!r}")
    if "kv_heads" in v and (isinstance(v["kv_heads"], bool) or not isinstance(v["kv_heads"], int) or v["kv_heads"] < 1):
        raise ConfigError(f"{where}.kv_heads must be an integer >= 1, got {v['kv_heads']!r}")
    if "mixer" in v and v["mixer"] not in MIXERS:
        raise ConfigError(f"{where}.mixer must be one of {', '.join(MIXERS)}, got {v['mixer']!r}")


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
