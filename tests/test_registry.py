"""The one table of workflows (workflows/registry.py) is whole and is what everything reads: every
preset file has exactly one owner, every registered name is a workflow class with that default
preset, every docs list and page names the registered workflows, and `zerograph` picks a preset's
workflow from it."""
from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import workflows
from workflows import registry
from workflows.cli import app, pick
from workflows.experiment import ConfiguredWorkflow, load_preset
from zgcore.config.experiment import ConfigError

ROOT = Path(__file__).resolve().parents[1]
LISTS = ("docs/slurm.md", "docs/internals.md")  # pages that list every workflow


def test_every_preset_file_has_exactly_one_owner_and_every_pattern_a_file():
    files = registry.preset_files()
    assert "library_tiny" in files and len(files) >= 10
    owners = {p: [w.name for w in registry.all_workflows() if w.owns(p)] for p in files}
    assert {p: o for p, o in owners.items() if len(o) != 1} == {}
    for w in registry.all_workflows():
        for pattern in w.presets:
            assert any(w.owns(p) and __import__("fnmatch").fnmatch(p, pattern) for p in files), (w.name, pattern)
        assert w.tiny in files and w.default_preset in files


@pytest.mark.parametrize("wf", registry.all_workflows(), ids=registry.names())
def test_every_registered_workflow_is_a_class_with_its_default_preset_and_a_docs_page(wf):
    cls = getattr(workflows, wf.name)
    assert isinstance(cls, type) and issubclass(cls, ConfiguredWorkflow) and wf.name in workflows.__all__
    assert dict(cls.get_param_values(cls.get_params(), [], {}))["preset"] == wf.default_preset
    assert wf.name in (ROOT / wf.doc).read_text(), f"{wf.doc} never names {wf.name}"
    assert pick(wf.tiny).name == wf.name and registry.schema_of(wf.default_preset) == wf.schema
    for page in LISTS:
        assert wf.name in (ROOT / page).read_text(), f"{page} lists the workflows but not {wf.name}"
    assert wf.answers.endswith("?") and wf.command().startswith(f"luigi --module workflows {wf.name} --preset {wf.tiny}")


def test_a_workflow_whose_tiny_preset_is_not_its_own_is_refused_by_name():
    with pytest.raises(ValueError, match="workflow Broken: preset 'tiny' is not among its presets"):
        registry.register(registry.Workflow("Broken", ("nothing_*",), "default", "tiny", "experiment", "?", "README.md"))
    assert "Broken" not in registry.names()


def test_a_preset_of_another_schema_names_its_workflow():
    with pytest.raises(ConfigError, match="preset 'local_tiny' belongs to LocalLearningStudy: run `luigi --module "
                                          "workflows LocalLearningStudy --preset local_tiny"):
        load_preset("local_tiny", "experiment")
    assert load_preset("study_tiny", "experiment")["name"] == "study-tiny"


def test_zerograph_names_an_unknown_workflow_or_preset_in_one_line():
    for args, what in ((["status", "--workflow", "Nope"], "unknown workflow 'Nope'"),
                       (["report", "--preset", "nope"], "unknown preset 'nope'")):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and what in r.stderr, r.output


def test_the_readme_table_has_a_row_per_workflow_with_both_commands():
    rows = registry.table().splitlines()[2:]
    assert [r.split("`")[1] for r in rows] == registry.names()
    distill = next(r for r in rows if r.startswith("| `DistillStudy`"))
    assert "--preset distill_tiny" in distill and "--preset distill --local-scheduler" in distill
