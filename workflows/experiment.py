"""Build an experiment's task graph from its configuration, validating it first."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks import Evaluate, ObjectiveStudyReport, SeedSummary, ZGTask
from zgcore import config as zconfig
from zgcore.teacher import describe

PRESETS = Path(__file__).parent / "presets"
STUDY_OBJECTIVES = ("clean", "noisy", "denoise")
STUDY_TARGETS = ("cached", "online")


def load_config(config: str = "", overrides: str = "", preset: str = "") -> dict[str, Any]:
    """Resolve an experiment: defaults < preset < file < overrides, and check it against the
    teacher's shape (config only — no weights are loaded).

    Raises:
        zgcore.config.ConfigError: anything that would fail later, with what to fix.
    """
    base = {}
    if preset:
        p = PRESETS / f"{preset}.toml"
        if not p.is_file():
            known = ", ".join(sorted(x.stem for x in PRESETS.glob("*.toml")))
            raise zconfig.ConfigError(f"unknown preset {preset!r}; known: {known}")
        base = zconfig.load_file(p)
    cfg = zconfig.resolve(config or None, overrides or None, base=base)
    info = describe(cfg["teacher"])
    zconfig.validate_against_teacher(cfg, info.n_layers, info.max_positions, cfg["teacher"])
    return cfg


def block_settings(cfg: dict[str, Any], seed: int | None = None, **train_over) -> list[dict[str, Any]]:
    """Each block's resolved train settings, with ``seed`` (if given) and ``train_over`` replacing
    those settings in every block."""
    out = []
    for i in range(int(cfg["boundary"]["num_blocks"])):
        t = zconfig.block_train_config(cfg, i)
        t.update(train_over)
        if seed is not None:
            t["seed"] = seed
        out.append(t)
    return out


def _common(cfg: dict[str, Any], outputs: str) -> dict[str, Any]:
    return dict(teacher=cfg["teacher"], corpus=cfg["corpus"], boundary=cfg["boundary"], eval=cfg["eval"],
                name=cfg["name"], outputs=outputs, device=cfg["device"])


def build_experiment(cfg: dict[str, Any], outputs: str = "outputs") -> ZGTask:
    """The root task of a resolved experiment: its Evaluate, or a SeedSummary over ``seeds``."""
    if not cfg.get("seeds"):
        return Evaluate(blocks=block_settings(cfg), **_common(cfg, outputs))
    return SeedSummary(seeds=list(cfg["seeds"]), blocks_per_seed=[block_settings(cfg, s) for s in cfg["seeds"]],
                       **_common(cfg, outputs))


def build_study(cfg: dict[str, Any], outputs: str = "outputs") -> ObjectiveStudyReport:
    """The objective study: {clean, noisy, denoise} x {cached, online} arms for every seed."""
    arms = []
    for obj in STUDY_OBJECTIVES:
        for tg in STUDY_TARGETS:
            for s in cfg.get("seeds") or [None]:
                blocks = block_settings(cfg, s, objective=obj, targets=tg)
                arms.append({"objective": obj, "targets": tg, "seed": blocks[0]["seed"], "blocks": blocks})
    return ObjectiveStudyReport(arms=arms, **_common(cfg, outputs))
