"""``luigi --module workflows ExportStudent --preset tiny --quant q4_k_m`` (and ``zerograph export --gguf``):
an experiment's student as a GGUF file for llama.cpp (docs/export.md).

The export is checked when the graph is built, before anything runs: a block whose token mixer llama.cpp
cannot run (``linear``, ``window``, ...) fails in one line naming the kinds that can
(:func:`zgcore.models.gguf_export.check_exportable`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import luigi

from zgcore.config import experiment as zconfig

from . import registry
from .experiment import RunExperiment, block_settings, load_config

if TYPE_CHECKING:
    from tasks.export import ExportGGUF


def build_export(cfg: dict[str, Any], outputs: str = "outputs", quant: str = "f32") -> ExportGGUF:
    """The ExportGGUF task of a resolved experiment's student (healed when ``heal.steps`` > 0).

    Raises:
        zgcore.config.experiment.ConfigError: seeds set, or a student llama.cpp cannot run (one line).
    """
    from tasks.export import ExportGGUF
    from zgcore.models import gguf_export
    from zgcore.models.costs import teacher_config

    if cfg.get("seeds"):
        raise zconfig.ConfigError("export writes one student: unset seeds (train.seed picks the run)")
    blocks = block_settings(cfg)
    tc = teacher_config(cfg["teacher"])
    rope = tc.to_dict().get("rope_parameters")
    gguf_export.check_exportable(gguf_export.mixers_of(blocks), tc.model_type, quant, rope)
    return ExportGGUF(teacher=cfg["teacher"], corpus=cfg["corpus"], boundary=cfg["boundary"], blocks=blocks,
                      heal=cfg["heal"], quant=quant, study=cfg["name"], outputs=outputs, device=cfg["device"])


def build_library_export(cfg: dict[str, Any], outputs: str = "outputs", quant: str = "f32",
                         budget: int = 0) -> ExportGGUF:
    """The ExportGGUF task of a library's pick (``SelectStudent``): the student chosen for
    ``library.budgets[budget]``, assembled without padding (its layers keep their own shapes).

    Raises:
        zgcore.config.experiment.ConfigError: no such budget, its selection not built yet (the message
            names the command that builds it), or a chosen block llama.cpp cannot run.
    """
    import json

    from tasks.export import ExportGGUF
    from zgcore.models import gguf_export
    from zgcore.models.costs import teacher_config

    from .library import build_library

    report = build_library(cfg, outputs)
    selections = report.requires()["selections"]
    if not 0 <= budget < len(selections):
        raise zconfig.ConfigError(f"--budget {budget}: the library has {len(selections)} budget(s), "
                                  f"0 to {len(selections) - 1}")
    sel = selections[budget]
    if not sel.complete():
        raise zconfig.ConfigError(f"library.budgets[{budget}] has no selection yet: run `.venv/bin/luigi --module "
                                  "workflows SelectStudent --local-scheduler` with the same options first")
    chosen = json.loads(sel.checked("selection.json").read_text())["chosen"]
    blocks = [dict(report.candidates[i][v]["train"]) for i, v in enumerate(chosen)]
    tc = teacher_config(cfg["teacher"])
    rope = tc.to_dict().get("rope_parameters")
    gguf_export.check_exportable(gguf_export.mixers_of(blocks), tc.model_type, quant, rope)
    return ExportGGUF(teacher=cfg["teacher"], corpus=cfg["corpus"], boundary=cfg["boundary"], blocks=blocks, exact=True,
                      quant=quant, study=cfg["name"], outputs=outputs, device=cfg["device"])


class ExportStudent(RunExperiment):
    """An experiment's student (the one ``RunExperiment`` with the same options builds) as
    ``model.gguf``: the task ``ExportGGUF``; with a ``SelectStudent`` preset, the library's pick for
    ``library.budgets[budget]`` (once ``SelectStudent`` has chosen it). Same parameters as
    :class:`RunExperiment`, plus ``quant`` (f32, f16, q8_0, q4_k_m) and ``budget``. Raises
    ``ConfigError`` at construction for a student llama.cpp cannot run."""

    quant = luigi.Parameter(default="f32",
                            description="f32 | f16 | q8_0 | q4_k_m (q8_0, q4_k_m: llama.cpp's quantizer)")
    budget = luigi.IntParameter(default=0,
                                description="with a SelectStudent preset: which library.budgets entry's pick")

    def resolve(self):
        owner = registry.owner(self.preset)
        if owner is not None and owner.name == "SelectStudent":
            from .library import library_plan

            cfg = load_config(self.config, self.set, self.preset)
            library_plan(cfg)  # its checks
            self.export = build_library_export(cfg, self.outputs, str(self.quant), int(self.budget))
            return cfg
        cfg = load_config(self.config, self.set, self.preset)
        self.export = build_export(cfg, self.outputs, str(self.quant))
        return cfg

    def requires(self):
        return self.export
