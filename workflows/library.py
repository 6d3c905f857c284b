"""``luigi --module workflows SelectStudent --preset library_tiny``: the best student for a budget,
chosen from a library of candidate blocks trained per partition (docs/library.md).

The plan is resolved before anything runs: every candidate's train settings (an experiment's
block settings with the variant's keys, so a candidate an experiment also asks for is the same
``TrainBlock``), its cost from its shape alone, the teacher's cost, and each budget in absolute
terms — a budget no choice fits fails here, naming the smallest feasible one.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import luigi

from zgcore.config import experiment as zconfig

from . import registry
from .experiment import RunExperiment, block_settings, load_config

if TYPE_CHECKING:
    from tasks.library_report import LibraryReport


def _where(cfg: dict[str, Any], i: int, j: int) -> str:
    own = str(i) in (cfg["library"].get("blocks") or {})
    return f"library.blocks.{i}.variants[{j}]" if own else f"library.variants[{j}] (partition {i})"


def library_plan(cfg: dict[str, Any]) -> dict[str, Any]:
    """The resolved library of a configuration: ``{"candidates": per partition [{"train", "name",
    "variant", "cost"}], "uniform": [{"name", "indices"}], "budgets": [{"raw", "budget"}],
    "unit", "teacher_cost", "extra"}`` (costs: ``{"params", "flops", "kv_bytes"}``).

    Raises:
        ConfigError: no variants or budgets, seeds or healing set, no test subset to keep the tuning
            rows apart (``eval.max_sequences`` 0), a variant the partition or family cannot build,
            or a budget below the smallest student (the message names it).
    """
    from zgcore.models.channels import mlp_width
    from zgcore.models.costs import block_cost, student_extra, teacher_config
    from zgcore.models.heads import kv_heads
    from zgcore.models.hetero import HETERO_FAMILIES
    from zgcore.models.shapes import resolve_boundaries

    lib = cfg["library"]
    _check_library(cfg)
    config = teacher_config(cfg["teacher"])
    width, tkv, seq = mlp_width(config), kv_heads(config), int(cfg["corpus"]["seq_len"])
    bs = resolve_boundaries(cfg["boundary"], int(config.num_hidden_layers))
    base = block_settings(cfg)
    parts = [_candidates(cfg, i, base[i], bs, config, width, tkv, seq) for i in range(len(bs) - 1)]
    shapes = {(c["train"]["intermediate_size"], c["train"].get("kv_heads")) for p in parts for c in p}
    if len(shapes) > 1 and config.model_type not in HETERO_FAMILIES:
        raise zconfig.ConfigError(f"variants of different mlp or kv_heads assemble into layers of their own shapes, built "
                                  f"for {', '.join(HETERO_FAMILIES)} teachers, not {config.model_type!r}: use one mlp "
                                  "and kv_heads for every variant")
    extra = student_extra(config)
    teacher_cost = {u: extra[u] + sum(block_cost(config, range(bs[i], bs[i + 1]), None, None, seq, context=int(lib["context"]))[u]
                                      for i in range(len(bs) - 1)) for u in extra}
    unit = lib["budget_unit"]
    low = extra[unit] + sum(min(c["cost"][unit] for c in p) for p in parts)
    budgets = _budgets(lib, low, teacher_cost[unit])
    return {"candidates": parts, "uniform": _uniform(cfg, parts, base, width, tkv), "budgets": budgets, "unit": unit,
            "teacher_cost": teacher_cost, "extra": extra}


def _check_library(cfg: dict[str, Any]) -> None:
    """The settings a library run needs (else ``ConfigError`` naming what to set)."""
    from zgcore.config import library

    if not library.active(cfg):
        raise zconfig.ConfigError("SelectStudent needs a library: set library.variants (or library.blocks.<i>.variants), "
                                  "e.g. --set 'library.variants=[{n_layers: 1}, {mlp: 0.5}]'")
    if not cfg["library"]["budgets"]:
        raise zconfig.ConfigError("library.budgets is empty: give one or more budgets, e.g. library.budgets=[0.7, 0.9]")
    if cfg.get("seeds"):
        raise zconfig.ConfigError("SelectStudent trains one seed: unset seeds (train.seed sets it)")
    if int(cfg["heal"]["steps"]):
        raise zconfig.ConfigError("SelectStudent scores students as assembled: set heal.steps=0")
    if not int(cfg["eval"]["max_sequences"]):
        raise zconfig.ConfigError("the library scores candidates on validation sequences outside the test subset, but "
                                  "eval.max_sequences = 0 makes every one a test sequence: set eval.max_sequences "
                                  "(e.g. half the validation split)")


def _candidates(cfg: dict[str, Any], i: int, base: dict[str, Any], bs: list[int], config, width: int, tkv: int,
                seq: int) -> list[dict[str, Any]]:
    """Partition ``i``'s candidates ``[{"train", "name", "variant", "cost"}]``, one per distinct block
    its variants name, each checked buildable (else ``ConfigError`` naming the variant)."""
    from zgcore.config import library
    from zgcore.models.costs import block_cost
    from zgcore.models.heads import check_kv_heads
    from zgcore.models.mixers import check_family, check_window
    from zgcore.models.shapes import n_kept

    cands, seen = [], {}
    for j, v in enumerate(library.partition_variants(cfg, i)):
        where = _where(cfg, i, j)
        t = library.candidate_train(base, v, width, tkv)
        try:
            zconfig.validate_train(t, where)
            n = n_kept(bs[i], bs[i + 1], t)
        except zconfig.ConfigError as e:
            raise zconfig.ConfigError(f"{where}: {e}") from None
        if t.get("kv_heads") is not None:
            check_kv_heads(config, t["kv_heads"], where)
        key = json.dumps(t, sort_keys=True, default=str)
        if key in seen:  # two tables naming one block: one candidate
            continue
        seen[key] = len(cands)
        if library.converted(t):
            check_family({f"{where}.mixer": t["mixer"]}, config.model_type)
            check_window(f"{where}: train.window", t["mixer"], t["window"], seq)
        cost = block_cost(config, range(bs[i], bs[i] + n), t["intermediate_size"], t.get("kv_heads"), seq,
                          t["mixer"], t["window"], int(cfg["library"]["context"]))
        cands.append({"train": t, "name": library.describe_variant(t, n, width, tkv), "variant": v, "cost": cost})
    if not cands:
        raise zconfig.ConfigError(f"partition {i} has no variant: set library.variants or library.blocks.{i}.variants")
    return cands


def _budgets(lib: dict[str, Any], low: float, teacher: float) -> list[dict[str, float]]:
    """``[{"raw", "budget"}]`` of ``library.budgets`` in the budget unit (``teacher``: the teacher's
    cost in it), each at least ``low``, the smallest student's (else ``ConfigError`` naming it)."""
    from zgcore.config import library

    unit, budgets = lib["budget_unit"], []
    for j, (raw, b) in enumerate(zip(lib["budgets"], library.budgets(lib, teacher))):
        if b < low:
            raise zconfig.ConfigError(
                f"library.budgets[{j}]={raw} is {b:,.0f} {unit}, below the smallest student the library can build: "
                f"{low:,.0f} {unit} ({low / teacher:.4f} of the teacher's {teacher:,.0f}); "
                f"raise it to at least {low:,.0f} (or {low / teacher:.4f})")
        budgets.append({"raw": float(raw), "budget": float(b)})
    return budgets


def _uniform(cfg: dict[str, Any], parts: list, base: list, width: int, tkv: int) -> list[dict[str, Any]]:
    """The uniform students ``[{"name", "indices"}]``: each first-partition variant taken in every
    partition, where every partition has it."""
    from zgcore.config import library

    uniform = []
    for v0 in library.partition_variants(cfg, 0):
        idx = []
        for i in range(len(parts)):
            t = library.candidate_train(base[i], v0, width, tkv)
            match = [k for k, c in enumerate(parts[i]) if c["train"] == t]
            idx.append(match[0] if match else None)
        name = parts[0][idx[0]]["name"] if idx[0] is not None else ""
        if None not in idx and all(u["indices"] != idx for u in uniform):
            uniform.append({"name": name, "indices": idx})
    return uniform


def build_library(cfg: dict[str, Any], outputs: str = "outputs", plan: dict[str, Any] | None = None) -> LibraryReport:
    """The library's report task for a resolved configuration (``plan``: :func:`library_plan`'s, if done)."""
    from tasks.library_report import LibraryReport

    plan = plan or library_plan(cfg)
    return LibraryReport(teacher=cfg["teacher"], corpus=cfg["corpus"], boundary=cfg["boundary"], eval=cfg["eval"],
                         candidates=[[{"train": c["train"], "name": c["name"]} for c in p] for p in plan["candidates"]],
                         uniform=plan["uniform"], budgets=plan["budgets"], unit=plan["unit"],
                         teacher_cost=plan["teacher_cost"], name=cfg["name"], outputs=outputs, device=cfg["device"],
                         context=int(cfg["library"]["context"]))


class SelectStudent(RunExperiment):
    """Train a library of candidate blocks per partition, score each in context, choose one per
    partition for every ``library.budgets`` entry exactly, assemble each chosen student without
    padding and evaluate it beside the uniform students (docs/library.md).

    Same parameters as :class:`RunExperiment`; the default preset is ``library`` (SmolLM2).
    Raises ``zgcore.config.experiment.ConfigError`` at construction on bad input, an infeasible budget included.
    """

    preset = luigi.Parameter(default=registry.get("SelectStudent").default_preset, description="preset in workflows/presets")

    def resolve(self):
        cfg = load_config(self.config, self.set, self.preset)
        self.plan = library_plan(cfg)
        return cfg

    def requires(self):
        return build_library(self.cfg, self.outputs, self.plan)
