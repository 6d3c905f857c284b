"""``luigi --module workflows DistillStudy --local-scheduler``: should I distil blockwise or end to end?"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import luigi

from zgcore.config import experiment as zconfig

from . import registry
from .experiment import RunExperiment, block_settings, load_config

if TYPE_CHECKING:
    from tasks.distill import DistillStudyReport
    from tasks.distill_seeds import DistillSeedsReport


def build_distill_study(cfg: dict[str, Any], outputs: str = "outputs") -> DistillStudyReport | DistillSeedsReport:
    """The report task over the four arms of one resolved experiment (``heal.steps`` > 0
    required); with ``seeds``, a :class:`DistillSeedsReport` over one study per seed (each seed
    replaces ``train.seed``, ``heal.seed`` and ``distill.seed``)."""
    from tasks.distill import DistillStudyReport
    from tasks.distill_seeds import DistillSeedsReport

    if cfg.get("seeds"):
        studies = [{"seed": int(s), "blocks": block_settings(cfg, s), "heal": {**cfg["heal"], "seed": int(s)},
                    "distill": {**cfg["distill"], "seed": int(s)}} for s in cfg["seeds"]]
        return DistillSeedsReport(teacher=cfg["teacher"], corpus=cfg["corpus"], boundary=cfg["boundary"], eval=cfg["eval"],
                                  studies=studies, name=cfg["name"], outputs=outputs, device=cfg["device"])
    return DistillStudyReport(teacher=cfg["teacher"], corpus=cfg["corpus"], boundary=cfg["boundary"],
                              blocks=block_settings(cfg), eval=cfg["eval"], heal=cfg["heal"], distill=cfg["distill"],
                              name=cfg["name"], outputs=outputs, device=cfg["device"])


class DistillStudy(RunExperiment):
    """The same student trained four ways on the same training tokens, reported side by side:
    (a) ZeroGraph blockwise (the experiment's own TrainBlocks, reused when finished); (b) end-to-end
    distillation on the teacher's logits (``distill.*``; optional hidden-state term at every
    boundary) at the same student layer-token passes as (a); (c) (a) then ``heal.steps`` of healing;
    (d) end-to-end distillation at the passes of (c). ``distill.lrs`` searches the lr of (b) and (d),
    ``train.lrs`` every block's (see docs/tuning.md).

    Same parameters as :class:`RunExperiment` (default preset ``default``); ``seeds = [0, 1]`` runs
    the four arms once per seed and pools the comparisons (:class:`tasks.distill_seeds.DistillSeedsReport`).
    Raises ``zgcore.config.experiment.ConfigError`` at construction on bad input, ``heal.steps = 0`` included.
    """

    preset = luigi.Parameter(default=registry.get("DistillStudy").default_preset, description="preset in workflows/presets")

    def resolve(self):
        from zgcore.models.shapes import check_one_width

        cfg = load_config(self.config, self.set, self.preset, seeded_heal=True)
        if not int(cfg["heal"]["steps"]):
            raise zconfig.ConfigError("DistillStudy needs heal.steps > 0 for its healed arm (c), e.g. --set heal.steps=50")
        check_one_width(block_settings(cfg))
        return cfg

    def requires(self):
        return build_distill_study(self.cfg, self.outputs)
