"""Top-level Luigi wrapper tasks: ``luigi --module workflows RunExperiment --local-scheduler``.

Importing this package (which ``luigi --module workflows`` does before it reads its exit codes)
sets Luigi's ``[retcode]`` values that the user's Luigi config leaves unset, so a failed run exits
non-zero from whatever folder it is started in, not only where the repository's ``luigi.cfg`` is read.
"""
from __future__ import annotations

import luigi
import luigi.configuration

from . import ending, failover
from .errors import install as install_error_filter
from .experiment import CONFIG_ERROR_EXIT, ConfiguredWorkflow, build_experiment, build_study, load_config
from .local import LocalLearningStudy

# Luigi's own default for every one of these is 0 ("a failed task exits 0"). Same values as luigi.cfg.
RETCODES = {"already_running": 10, "missing_data": 20, "not_run": 25, "task_failed": 30, "scheduling_error": 35,
            "unhandled_exception": 40}


def set_default_retcodes(config=None) -> None:
    """Write :data:`RETCODES` into Luigi's configuration where it has no value of its own."""
    config = config if config is not None else luigi.configuration.get_config()
    if not config.has_section("retcode"):
        config.add_section("retcode")
    for key, code in RETCODES.items():
        if not config.has_option("retcode", key):
            config.set("retcode", key, str(code))


set_default_retcodes()
install_error_filter()  # user errors raised inside a task: one `error:` line, no traceback (workflows/errors.py)
ending.install()  # the `luigi` command's exit code, last line and Ctrl-C (workflows/ending.py)
failover.install()  # a task that raised is disabled at once; a lost worker's task is retried (workflows/failover.py)


class RunExperiment(ConfiguredWorkflow):
    """Run one experiment end to end: teacher → boundaries → blocks → assembled student → report.

    Parameters:
        config: a TOML or YAML experiment file (optional).
        set: overrides, e.g. ``"train.lr=1e-4 blocks.1.lr=5e-5"``.
        preset: a named preset from ``workflows/presets`` (``default``, ``tiny``, ``smoke``).
        outputs: root folder of run artifacts.

    Bad input fails at construction — before any task runs — with one ``error:`` line and exit
    code ``CONFIG_ERROR_EXIT`` (2).
    """

    preset = luigi.Parameter(default="default", description="preset in workflows/presets")

    def resolve(self):
        return load_config(self.config, self.set, self.preset)

    def requires(self):
        return build_experiment(self.cfg, self.outputs)


class PrepareInputs(RunExperiment):
    """Only an experiment's teacher and tokenised corpus (``PrepareTeacher``, ``PrepareCorpus``).
    Run once before starting workers on a cluster: with the corpus known, every worker schedules
    the teacher cache's ``BoundaryShard`` tasks and luigid shares them out. Same parameters as
    :class:`RunExperiment`."""

    def requires(self):
        from tasks.teacher import PrepareCorpus

        return PrepareCorpus(teacher=self.cfg["teacher"], corpus=self.cfg["corpus"], outputs=self.outputs)


class ObjectiveStudy(RunExperiment):
    """The composition study: {clean, noisy, denoise} x {cached, online} on one teacher, corpus,
    seeds and teacher cache, with one comparison report (``ObjectiveStudyReport``).

    Same parameters as :class:`RunExperiment`; the default preset is ``study``.
    Source: ZeroGraph (arXiv:2611.02200), six-arm study.
    """

    preset = luigi.Parameter(default="study", description="preset in workflows/presets")

    def requires(self):
        return build_study(self.cfg, self.outputs)


class ConvertStudy(RunExperiment):
    """The conversion method question: block-boundary regression alone (``clean``) against attention
    transfer then regression (``attention_transfer``), at matched steps, cached targets, every seed,
    one comparison report (run-level verdict over ``seeds``). Default preset ``convert_study``
    (docs/conversion.md). Source: LoLCATs (arXiv:2410.10254), attention transfer."""

    preset = luigi.Parameter(default="convert_study", description="preset in workflows/presets")

    def requires(self):
        return build_study(self.cfg, self.outputs, ("clean", "attention_transfer"), ("cached",))


from .distill import DistillStudy  # noqa: E402 (subclasses RunExperiment)
from .library import SelectStudent  # noqa: E402 (subclasses RunExperiment)

__all__ = ["RunExperiment", "PrepareInputs", "ObjectiveStudy", "ConvertStudy", "LocalLearningStudy", "DistillStudy", "SelectStudent", "build_experiment",
           "build_study", "load_config", "CONFIG_ERROR_EXIT", "RETCODES"]
