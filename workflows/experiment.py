"""Build an experiment's task graph from its configuration, validating it first."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks import Evaluate
from zgcore import config as zconfig
from zgcore.teacher import describe

PRESETS = Path(__file__).parent / "presets"


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


def build_experiment(cfg: dict[str, Any], outputs: str = "outputs") -> Evaluate:
    """The Evaluate task (and through it the whole graph) for a resolved experiment config."""
    k = int(cfg["boundary"]["num_blocks"])
    return Evaluate(teacher=cfg["teacher"], corpus=cfg["corpus"], boundary=cfg["boundary"],
                    blocks=[zconfig.block_train_config(cfg, i) for i in range(k)], eval=cfg["eval"],
                    name=cfg["name"], outputs=outputs, device=cfg["device"])
