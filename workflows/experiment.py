"""Build an experiment's task graph from its configuration, validating it first."""
from __future__ import annotations

import os
import sys
import traceback
from typing import TYPE_CHECKING, Any, TypeVar
from collections.abc import Callable

import luigi
from luigi.cmdline_parser import CmdlineParser

from zgcore.config import experiment as zconfig

from . import registry
from .registry import PRESETS

if TYPE_CHECKING:
    from tasks import ObjectiveStudyReport, ZGTask
STUDY_OBJECTIVES = ("clean", "noisy", "denoise")
STUDY_TARGETS = ("cached", "online")
# Exit code of every configuration error (`luigi --module workflows ...` and `zerograph`): nothing ran.
# Distinct from `zerograph status`'s 1 (not all done) and from Luigi's retcodes (10-40, luigi.cfg).
CONFIG_ERROR_EXIT = 2
TRACEBACK_ENV = "ZG_TRACEBACK"  # set to 1 to see the traceback of a configuration error
T = TypeVar("T")


def or_exit(make: Callable[[], T]) -> T:
    """``make()``, or — on :class:`zgcore.config.experiment.ConfigError` — print ``error: <what to fix>`` on
    stderr and exit with :data:`CONFIG_ERROR_EXIT` (the traceback too when ``ZG_TRACEBACK=1``).

    Luigi builds the workflow task while it parses the command line and turns any exception into
    a 30-70 line traceback and exit 40; a configuration error is the user's to fix, not a crash."""
    try:
        return make()
    except zconfig.ConfigError as e:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            traceback.print_exc()
        print(f"error: {e}\n(nothing ran; {TRACEBACK_ENV}=1 shows the traceback)", file=sys.stderr, flush=True)
        sys.exit(CONFIG_ERROR_EXIT)


def load_preset(preset: str, schema: str = "experiment") -> dict[str, Any]:
    """The mapping of ``workflows/presets/<preset>.toml`` ({} for an empty name), for a workflow whose
    presets follow ``schema`` (``experiment`` or ``local``; :mod:`workflows.registry`).

    Raises:
        zgcore.config.experiment.ConfigError: no such preset (the message lists the presets of
            ``schema``), or a preset of another schema (the message names its workflow and the command
            that runs it).
    """
    if not preset:
        return {}
    mine = registry.presets_of_schema(schema)
    if not (PRESETS / f"{preset}.toml").is_file():
        raise zconfig.ConfigError(f"unknown preset {preset!r}; known: {', '.join(mine)}")
    other = registry.owner(preset)
    if other is None:
        raise zconfig.ConfigError(f"preset {preset!r} belongs to no registered workflow (workflows/registry.py)")
    if other.schema != schema:
        raise zconfig.ConfigError(f"preset {preset!r} belongs to {', '.join(registry.workflows_of_schema(other.schema))}: "
                                  f"run `{other.command(preset)}`; this workflow's presets: {', '.join(mine)}")
    return zconfig.load_file(PRESETS / f"{preset}.toml")


class OverridesParameter(luigi.Parameter):
    """``--set``, which may be repeated on Luigi's command line: the values are kept in order, one
    per line (Luigi's own parameters keep only the last one), and
    :func:`zgcore.config.experiment.parse_overrides` applies them in that order, so a key given twice takes
    its later value. From Python it is a plain string."""

    @classmethod
    def _parser_kwargs(cls, param_name, task_name=None):
        return {**super()._parser_kwargs(param_name, task_name), "action": "append"}

    def parse(self, x):
        return "\n".join(x) if isinstance(x, (list, tuple)) else x


class ConfiguredWorkflow(luigi.WrapperTask):
    """Base of the top-level workflows: a preset, an optional file and overrides resolve to
    ``self.cfg`` at construction — before any task runs — so bad input fails at once with
    :class:`zgcore.config.experiment.ConfigError`; on the ``luigi`` command line it prints one ``error:`` line
    and exits :data:`CONFIG_ERROR_EXIT` instead (see :func:`or_exit`). Subclasses set the
    ``preset`` default and :meth:`resolve`."""

    config = luigi.Parameter(default="", description="experiment file (.toml/.yaml)")
    set = OverridesParameter(default="", description='overrides, e.g. "train.lr=1e-4 blocks.1.lr=5e-5" (repeatable: '
                                                     'applied in order, a later key wins)')
    outputs = luigi.Parameter(default="outputs", description="root folder of run artifacts")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # On the `luigi` command line (Luigi builds this task while parsing it) a configuration error
        # is one line and exit 2; built from Python (luigi.build, tests) it raises ConfigError.
        if CmdlineParser.get_instance() is None:
            self.cfg = self.resolve()
            return
        self.cfg = or_exit(self.resolve)
        from .preflight import check_outputs  # the `luigi` command writes there; `zerograph status` only reads

        or_exit(lambda: check_outputs(self.outputs))

    def resolve(self) -> dict[str, Any]:
        """The resolved, validated configuration of this workflow."""
        raise NotImplementedError


def load_config(config: str = "", overrides: str = "", preset: str = "", seeded_heal: bool = False) -> dict[str, Any]:
    """Resolve an experiment: defaults < preset < file < overrides, and check it against the
    teacher's shape (config only — no weights are loaded). ``seeded_heal``: allow ``heal.steps`` with
    ``seeds`` (the distillation study heals every seed's student; an experiment does not).

    Raises:
        zgcore.config.experiment.ConfigError: anything that would fail later, with what to fix.
    """
    from zgcore.models.teacher import describe

    cfg = zconfig.resolve(config or None, overrides or None, base=load_preset(preset))
    info = describe(cfg["teacher"])
    zconfig.validate_against_teacher(cfg, info.n_layers, info.max_positions, cfg["teacher"], info.mlp_width)
    check_kv_heads(cfg)
    check_mixers(cfg, info.model_type)
    warn_teacher_copies(cfg, info.n_layers, info.mlp_width)
    stream_teacher(cfg)
    from .preflight import check_held_out

    check_held_out(cfg)
    if int(cfg["heal"]["steps"]) and cfg.get("seeds") and not seeded_heal:
        raise zconfig.ConfigError("heal.steps > 0 applies to single-seed experiments; unset seeds or set heal.steps=0 "
                                  "(DistillStudy heals every seed's student)")
    return cfg


_WARNED: set[str] = set()


def warn_teacher_copies(cfg: dict[str, Any], n_layers: int, mlp_width: int | None) -> None:
    """One ``warning:`` line on stderr (once per process) naming the blocks whose student is its
    partition's teacher layers unchanged (:func:`zgcore.models.shapes.teacher_copies`): nothing is
    learnt there (a loss of 0 from the first step), e.g. the default three blocks on a 4-layer teacher.
    A library's candidates (``library.variants``, ``library.blocks``) are not checked: the teacher's
    own layers are a candidate there on purpose."""
    from zgcore.models.shapes import resolve_boundaries, teacher_copies

    if cfg.get("library", {}).get("variants") or cfg.get("library", {}).get("blocks"):
        return

    trains = [zconfig.block_train_config(cfg, i) for i in range(int(cfg["boundary"]["num_blocks"]))]
    copies = teacher_copies(resolve_boundaries(cfg["boundary"], n_layers), trains, mlp_width)
    msg = (f"warning: block(s) {', '.join(map(str, copies))} keep every layer of their partition of the teacher's "
           f"{n_layers}, with teacher init and its attention and MLP width: the student equals the teacher there "
           "(loss 0, nothing to learn); keep fewer (train.keep_fraction, train.n_layers) or cut fewer blocks "
           "(boundary.num_blocks)")
    if copies and msg not in _WARNED:
        _WARNED.add(msg)
        print(msg, file=sys.stderr, flush=True)
def stream_teacher(cfg: dict[str, Any]) -> None:
    """Hand ``teacher_stream`` to this process's tasks and their workers (the environment's
    :data:`zgcore.models.teacher_stream.ENV`): how the teacher runs, never what it computes (not hashed)."""
    import os

    from zgcore.models.teacher_stream import ENV

    os.environ[ENV] = str(cfg["teacher_stream"]).lower()


def check_mixers(cfg: dict[str, Any], model_type: str) -> None:
    """Check the blocks' ``mixer`` against the teacher's family: a converted mixer names the families
    that can take it. Raises :class:`zgcore.config.experiment.ConfigError`."""
    from zgcore.models.mixers import check_family

    check_family({f"blocks.{i}.mixer" if "mixer" in cfg["blocks"].get(str(i), {}) else "train.mixer":
                  zconfig.block_train_config(cfg, i)["mixer"] for i in range(int(cfg["boundary"]["num_blocks"]))}, model_type)


def check_kv_heads(cfg: dict[str, Any]) -> None:
    """Check the blocks' ``kv_heads`` against the teacher (its config only): each divides the
    teacher's key-value heads in a family that allows fewer, and every block has the same count (one
    student config carries it). Raises :class:`zgcore.config.experiment.ConfigError`."""
    kv = [zconfig.block_train_config(cfg, i)["kv_heads"] for i in range(int(cfg["boundary"]["num_blocks"]))]
    if all(k is None for k in kv):
        return
    from zgcore.models.costs import teacher_config
    from zgcore.models.heads import check_kv_heads as check

    tc = teacher_config(cfg["teacher"])
    for i, k in enumerate(kv):
        if k is not None:
            check(tc, int(k), f"block {i}")
    if len(set(kv)) > 1:
        raise zconfig.ConfigError(f"the blocks' kv_heads differ ({kv}): an experiment's student has one key-value head "
                                  "count; set one train.kv_heads (SelectStudent builds students whose layers differ)")


def walk(task: ZGTask) -> list[ZGTask]:
    """Every task of the graph under ``task``, dependencies first, each once."""
    from luigi.task import flatten

    seen: dict[str, ZGTask] = {}

    def visit(t):
        for d in flatten(t.requires()):
            visit(d)
        seen.setdefault(t.task_id, t)

    visit(task)
    return list(seen.values())


def block_settings(cfg: dict[str, Any], seed: int | None = None, **train_over) -> list[dict[str, Any]]:
    """Each block's resolved train settings, with ``seed`` (if given) and ``train_over`` replacing
    those settings in every block. A block that searches its lr (``lrs``) also carries ``tune``:
    the test subset's settings (``eval.max_sequences``, ``eval.subset_seed``), so that its
    candidates are scored on the validation sequences outside it (:func:`zgcore.evaluation.metrics.tune_subset`)."""
    out = []
    for i in range(int(cfg["boundary"]["num_blocks"])):
        t = zconfig.block_train_config(cfg, i)
        t.update(train_over)
        if seed is not None:
            t["seed"] = seed
        if t.get("lrs"):
            t["tune"] = {"max_sequences": int(cfg["eval"]["max_sequences"]), "subset_seed": int(cfg["eval"]["subset_seed"])}
        out.append(t)
    return out


def _common(cfg: dict[str, Any], outputs: str) -> dict[str, Any]:
    return dict(teacher=cfg["teacher"], corpus=cfg["corpus"], boundary=cfg["boundary"], eval=cfg["eval"],
                name=cfg["name"], outputs=outputs, device=cfg["device"])


def build_experiment(cfg: dict[str, Any], outputs: str = "outputs") -> ZGTask:
    """The root task of a resolved experiment: its Evaluate, or a SeedSummary over ``seeds``."""
    from tasks import Evaluate, SeedSummary

    if not cfg.get("seeds"):
        return Evaluate(blocks=block_settings(cfg), heal=cfg["heal"], **_common(cfg, outputs))
    return SeedSummary(seeds=list(cfg["seeds"]), blocks_per_seed=[block_settings(cfg, s) for s in cfg["seeds"]],
                       **_common(cfg, outputs))


def build_study(cfg: dict[str, Any], outputs: str = "outputs", objectives: tuple[str, ...] = STUDY_OBJECTIVES,
                targets: tuple[str, ...] = STUDY_TARGETS) -> ObjectiveStudyReport:
    """The objective study: {clean, noisy, denoise} x {cached, online} arms for every seed (or the
    given ``objectives`` x ``targets``, e.g. the conversion study's clean vs attention_transfer)."""
    from tasks import ObjectiveStudyReport

    arms = []
    for obj in objectives:
        for tg in targets:
            for s in cfg.get("seeds") or [None]:
                blocks = block_settings(cfg, s, objective=obj, targets=tg)
                arms.append({"objective": obj, "targets": tg, "seed": blocks[0]["seed"], "blocks": blocks})
    return ObjectiveStudyReport(arms=arms, **_common(cfg, outputs))


class RunExperiment(ConfiguredWorkflow):
    """Run one experiment end to end: teacher → boundaries → blocks → assembled student → report.

    Parameters:
        config: a TOML or YAML experiment file (optional).
        set: overrides, e.g. ``"train.lr=1e-4 blocks.1.lr=5e-5"``.
        preset: a named preset from ``workflows/presets`` (``default``, ``tiny``, ...; any preset of
            the experiment schema, :mod:`workflows.registry`).
        outputs: root folder of run artifacts.

    Bad input fails at construction — before any task runs — with one ``error:`` line and exit
    code ``CONFIG_ERROR_EXIT`` (2).
    """

    preset = luigi.Parameter(default=registry.get("RunExperiment").default_preset, description="preset in workflows/presets")

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

    preset = luigi.Parameter(default=registry.get("ObjectiveStudy").default_preset, description="preset in workflows/presets")

    def requires(self):
        return build_study(self.cfg, self.outputs)


class ConvertStudy(RunExperiment):
    """The conversion method question: block-boundary regression alone (``clean``) against attention
    transfer then regression (``attention_transfer``), at matched steps, cached targets, every seed,
    one comparison report (run-level verdict over ``seeds``). Default preset ``convert_study``
    (docs/conversion.md). Source: LoLCATs (arXiv:2410.10254), attention transfer."""

    preset = luigi.Parameter(default=registry.get("ConvertStudy").default_preset, description="preset in workflows/presets")

    def requires(self):
        return build_study(self.cfg, self.outputs, ("clean", "attention_transfer"), ("cached",))
