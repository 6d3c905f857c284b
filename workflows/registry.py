"""The one table of ZeroGraph's top-level workflows: what each is called, which presets it owns, its
tiny preset, how its root task and its report are found, and where it is documented.

Everything that lists or picks a workflow reads it: ``zerograph status/report/verify`` (which
workflow a preset belongs to, its root task, its report), ``zerograph slurm`` (the workflows a
launch can run), the presets' owner check (:func:`workflows.experiment.load_preset`), the docs'
list and the README's workflow table (``tests/test_registry.py``, ``tests/test_readme.py``) and the
contract test that runs every workflow on its tiny preset (``tests/test_workflow_contract.py``).
A workflow added tomorrow is registered here once, and every one of those checks covers it.

Follows scikit-learn's ``all_estimators()``: the registry is data, discovered by the checks.
This module imports nothing heavy (no Luigi, no torch): ``zerograph --help`` reads it.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

PRESETS = Path(__file__).parent / "presets"


@dataclass(frozen=True)
class Workflow:
    """One registered workflow.

    Attributes:
        name: its Luigi task family (``luigi --module workflows <name>``), a class in :mod:`workflows`.
        presets: ``fnmatch`` patterns of the presets it owns (``workflows/presets/<preset>.toml``);
            every preset file is owned by exactly one workflow (the test says so).
        default_preset: the preset it runs without ``--preset`` (a real, long run; one of its own
            schema, not necessarily its own: ``DistillStudy`` runs the default experiment's); the
            workflow class's ``preset`` parameter takes its default from here.
        tiny: its seconds-long preset, which the contract test runs.
        schema: the configuration its presets follow: ``"experiment"`` (``zgcore.config.defaults``) or
            ``"local"`` (``zgcore.local.config``); a workflow reads any preset of its own schema.
        answers: the question it answers, in one line (the README's table).
        doc: its docs page, relative to the repository root.
        report: the file, in its root task's folder, that ``zerograph report`` prints.
        real: the preset of its documented real run, when not ``default_preset``.
    """
    name: str
    presets: tuple[str, ...]
    default_preset: str
    tiny: str
    schema: str
    answers: str
    doc: str
    report: str = "report.md"
    real: str = ""

    def owns(self, preset: str) -> bool:
        """Whether ``preset`` is one of this workflow's own presets."""
        return any(fnmatch.fnmatch(preset, p) for p in self.presets)

    def command(self, preset: str | None = None) -> str:
        """The ``luigi`` command that runs it on ``preset`` (default: its tiny preset)."""
        return f"luigi --module workflows {self.name} --preset {preset or self.tiny} --local-scheduler"


_REGISTRY: dict[str, Workflow] = {}


def register(wf: Workflow) -> Workflow:
    """Add ``wf`` to the registry (replacing one of the same name); returns it.

    Raises:
        ValueError: a schema other than ``experiment`` or ``local``, or a tiny or default preset
            that ``wf`` does not own.
    """
    if wf.schema not in ("experiment", "local"):
        raise ValueError(f"workflow {wf.name}: schema must be 'experiment' or 'local', not {wf.schema!r}")
    if wf.real and not wf.owns(wf.real):
        raise ValueError(f"workflow {wf.name}: preset {wf.real!r} is not among its presets {wf.presets}")
    if not wf.owns(wf.tiny):
        raise ValueError(f"workflow {wf.name}: preset {wf.tiny!r} is not among its presets {wf.presets}")
    _REGISTRY[wf.name] = wf
    return wf


def unregister(name: str) -> None:
    """Remove a workflow (tests that register a dummy take it out again)."""
    _REGISTRY.pop(name, None)


def all_workflows() -> list[Workflow]:
    """Every registered workflow, in registration order."""
    return list(_REGISTRY.values())


def names() -> list[str]:
    """The registered workflows' names, in registration order."""
    return list(_REGISTRY)


def get(name: str) -> Workflow:
    """The workflow called ``name``.

    Raises:
        KeyError: no such workflow (the message lists the registered ones).
    """
    if name not in _REGISTRY:
        raise KeyError(f"unknown workflow {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def preset_files() -> list[str]:
    """The names of every preset file in ``workflows/presets``."""
    return sorted(p.stem for p in PRESETS.glob("*.toml"))


def owner(preset: str) -> Workflow | None:
    """The workflow that owns ``preset`` (``None``: no workflow does)."""
    return next((w for w in _REGISTRY.values() if w.owns(preset)), None)


def schema_of(preset: str) -> str | None:
    """The schema of ``preset``'s owner (``None`` for a preset nobody owns)."""
    w = owner(preset)
    return w.schema if w else None


def presets_of_schema(schema: str) -> list[str]:
    """Every preset file whose owner follows ``schema``."""
    return [p for p in preset_files() if schema_of(p) == schema]


def workflows_of_schema(schema: str) -> list[str]:
    """The names of the workflows that read presets of ``schema``."""
    return [w.name for w in _REGISTRY.values() if w.schema == schema]


def table(luigi: str = ".venv/bin/luigi") -> str:
    """A Markdown table of every registered workflow: what it answers, its tiny command, its real
    command and its docs page (for the README's list of workflows; ``luigi``: how the command is spelled)."""
    rows = ["| workflow | what it answers | seconds-long run | real run | docs |", "|---|---|---|---|---|"]
    for w in _REGISTRY.values():
        real = w.command(w.real or w.default_preset).replace("luigi", luigi, 1)
        rows.append(f"| `{w.name}` | {w.answers} | `{w.command().replace('luigi', luigi, 1)}` | `{real}` | [{w.doc}]({w.doc}) |")
    return "\n".join(rows)


register(Workflow("RunExperiment", ("default", "tiny", "heal_topk", "heal_topk_tiny", "convert", "convert_tiny"), "default", "tiny", "experiment",
                  "How close does a blockwise-trained student get to its teacher?", "README.md"))
register(Workflow("ObjectiveStudy", ("study", "study_tiny"), "study", "study_tiny", "experiment",
                  "Which block objective composes best: clean, noisy or denoising targets, cached or online?",
                  "docs/studies.md"))
register(Workflow("DistillStudy", ("distill", "distill_tiny"), "default", "distill_tiny", "experiment",
                  "Should I distil blockwise or end to end, with or without healing?", "docs/studies.md",
                  real="distill"))
register(Workflow("LocalLearningStudy", ("local_*",), "local_default", "local_tiny", "local",
                  "Does greedy local learning match end-to-end pretraining at the same token budget?",
                  "docs/local_learning.md"))
register(Workflow("SelectStudent", ("library", "library_tiny", "convert_library", "convert_library_tiny"), "library", "library_tiny", "experiment",
                  "Which mix of candidate blocks gives the best student for a parameter or FLOPs budget?",
                  "docs/library.md"))
register(Workflow("ConvertStudy", ("convert_study", "convert_study_tiny"), "convert_study", "convert_study_tiny",
                  "experiment", "Does attention transfer before boundary regression convert a teacher's attention better "
                  "than regression alone?", "docs/conversion.md"))
