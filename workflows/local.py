"""``luigi --module workflows LocalLearningStudy --local-scheduler``: the greedy local learning study."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import luigi

from zgcore.config import experiment as zconfig

from . import registry
from .experiment import ConfiguredWorkflow, load_preset

if TYPE_CHECKING:
    from tasks.local_report import LocalStudyReport


def load_local_config(config: str = "", overrides: str = "", preset: str = "local_default") -> dict[str, Any]:
    """Resolve a study: ``LOCAL_DEFAULTS`` < preset (``workflows/presets/<preset>.toml``) < file <
    overrides, validate every configuration, and check ``corpus.seq_len`` against the tokenizer's
    context (config only; nothing is downloaded or trained).

    Raises:
        zgcore.config.experiment.ConfigError: what to fix (K above the layer count, an MTP boundary that does not
            exist, an unknown aux head, an unknown preset or key, a pipeline on a device without a
            torch.distributed backend, ...).
    """
    from zgcore import local as zlocal
    from zgcore.local.pipeline import check_pipeline
    from zgcore.models.teacher import describe

    cfg = zlocal.resolve_local(config or None, overrides or None, base=load_preset(preset, "local"))
    for cell in zlocal.expand_study(cfg):  # a pipeline's settings and device (this host's cores: the task checks)
        if cell["run"]["train"]["execution"] == "pipeline":
            check_pipeline(int(cell["K"]), cfg["device"], cell["run"]["train"], capacity=False)
    info = describe(cfg["tokenizer"])
    if int(cfg["corpus"]["seq_len"]) > info.max_positions:
        raise zconfig.ConfigError(f"corpus.seq_len={cfg['corpus']['seq_len']} exceeds the context of {cfg['tokenizer']} "
                                  f"({info.max_positions} tokens)")
    return cfg


def build_local_study(cfg: dict[str, Any], outputs: str = "outputs") -> LocalStudyReport:
    """The report task (and through it every configuration's pretraining and evaluation)."""
    from tasks.local_report import LocalStudyReport
    from zgcore import local as zlocal

    lrs = zlocal.study_lrs(cfg)
    return LocalStudyReport(tokenizer=cfg["tokenizer"], corpus=cfg["corpus"], cells=zlocal.expand_seeds(cfg),
                            eval=cfg["eval"], name=cfg["name"], outputs=outputs, device=cfg["device"],
                            checkpoint_every=int(cfg["train"]["checkpoint_every"]), lrs=lrs,
                            tensorboard=bool(cfg["train"]["tensorboard"]),
                            tune_fraction=float(cfg["study"]["tune_fraction"]) if lrs else 1.0,
                            lr_rounds=int(cfg["study"]["lr_rounds"]) if lrs else 1,
                            search_seeds=[int(x) for x in cfg["study"].get("search_seeds") or []] if lrs else [])


class LocalLearningStudy(ConfiguredWorkflow):
    """Greedy local learning vs end-to-end at a matched token budget: K x aux head x MTP, one report.

    Parameters:
        config: a TOML/YAML file of overrides (optional). set: ``"local.mtp_n=3 study.K=[1,2]"``.
        preset: ``local_default`` (CPU, ~30 min), ``local_cpu_2tpp`` (CPU, 2 tokens per non-embedding
            parameter with an lr grid, 18.5 min with two workers), ``local_cpu_10tpp`` (CPU, 10 tokens per
            non-embedding parameter, each configuration's lr searched at the full budget; 76 min measured),
            ``local_cpu_5seed`` (CPU, five runs per configuration at fixed lrs and a FLOPs-matched K=1 arm),
            ``local_cpu_pipeline`` (CPU, the asynchronous pipeline against per_block at K=2, three runs each),
            ``local_tiny`` (seconds), ``local_gpu_125m``, ``local_gpu_400m`` (20 tokens per non-embedding parameter).
        outputs: root folder of run artifacts.

    Raises ``zgcore.config.experiment.ConfigError`` at construction, before any task runs, on bad input.
    """

    preset = luigi.Parameter(default=registry.get("LocalLearningStudy").default_preset,
                             description="preset in workflows/presets (local_*)")

    def resolve(self):
        return load_local_config(self.config, self.set, self.preset)

    def requires(self):
        return build_local_study(self.cfg, self.outputs)
