"""Top-level Luigi wrapper tasks: ``luigi --module workflows RunExperiment --local-scheduler``."""
from __future__ import annotations

import luigi

from .experiment import ConfiguredWorkflow, build_experiment, build_study, load_config
from .local import LocalLearningStudy


class RunExperiment(ConfiguredWorkflow):
    """Run one experiment end to end: teacher → boundaries → blocks → assembled student → report.

    Parameters:
        config: a TOML or YAML experiment file (optional).
        set: overrides, e.g. ``"train.lr=1e-4 blocks.1.lr=5e-5"``.
        preset: a named preset from ``workflows/presets`` (``default``, ``tiny``, ``smoke``).
        outputs: root folder of run artifacts.

    Raises ``zgcore.config.ConfigError`` at construction — before any task runs — on bad input.
    """

    preset = luigi.Parameter(default="default", description="preset in workflows/presets")

    def resolve(self):
        return load_config(self.config, self.set, self.preset)

    def requires(self):
        return build_experiment(self.cfg, self.outputs)


class ObjectiveStudy(RunExperiment):
    """The composition study: {clean, noisy, denoise} x {cached, online} on one teacher, corpus,
    seeds and teacher cache, with one comparison report (``ObjectiveStudyReport``).

    Same parameters as :class:`RunExperiment`; the default preset is ``study``.
    Source: ZeroGraph (arXiv:2611.02200), six-arm study.
    """

    preset = luigi.Parameter(default="study", description="preset in workflows/presets")

    def requires(self):
        return build_study(self.cfg, self.outputs)


from .distill import DistillStudy  # noqa: E402 (subclasses RunExperiment)

__all__ = ["DistillStudy", "RunExperiment", "ObjectiveStudy", "LocalLearningStudy", "build_experiment", "build_study", "load_config"]
