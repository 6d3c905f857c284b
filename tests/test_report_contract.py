"""The report contract, over every report of every tiny preset: each tiny preset
(``workflows/presets/*_tiny.toml`` and ``tiny.toml``, discovered) runs once per session by the
workflow that owns it (conftest's ``smoke_run``), and every ``report.json`` and ``report.md`` it wrote is checked by name:

* ``verdict_on_smoke``: a smoke preset (a random teacher) gives no verdict;
* ``verdict_from_few_runs``: no trained-configuration comparison (unit ``run``) has a verdict from fewer than 3 runs;
* ``documents``: every comparison carries its ``documents`` count, or ``independent`` (the corpus had none);
* ``flops``: every arm of a study (distillation arms, objective-study and local-learning rows, the
  library's selected and uniform students) carries its FLOPs;
* ``placeholder``: no template placeholder (``{name}``, ``{x['k']}``) is left in a rendered report.md.

A deliberately broken dummy report shows each rule failing by name.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.workflow_checks import smoke_presets
from zgcore.evaluation.compare import MIN_RUNS, NOT_RESOLVED

PRESETS = Path(__file__).resolve().parents[1] / "workflows" / "presets"
PLACEHOLDER = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*(\[[^\]\n]*\]|\.[A-Za-z_]+)*(![rs])?(:[^{}\n]*)?\}")
ARM_LISTS = ("arms", "rows", "selections", "uniform")  # report keys whose entries are a study's arms


def comparisons(tree, path="$"):
    """Every comparison dict (``a``, ``b`` and ``verdict``) in a report's JSON, with where it sits."""
    if isinstance(tree, dict):
        if {"a", "b", "verdict"} <= set(tree):
            yield path, tree
        for k, v in tree.items():
            yield from comparisons(v, f"{path}.{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from comparisons(v, f"{path}[{i}]")


def arms(report: dict):
    """``(where, entry)`` for every arm of a study report: the entries of :data:`ARM_LISTS` lists
    that name an arm (``name``, ``arm`` or ``budget``)."""
    for key in ARM_LISTS:
        for i, e in enumerate(report.get(key) or [] if isinstance(report.get(key), list) else []):
            if isinstance(e, dict) and {"name", "arm", "budget"} & set(e):
                yield f"$.{key}[{i}]", e


def violations(report: dict, markdown: str | None, smoke: bool) -> list[str]:
    """Each broken rule as ``"<rule>: <where>"`` (empty: the report keeps the contract)."""
    out = []
    for where, c in comparisons(report):
        if smoke and c["verdict"] != NOT_RESOLVED:
            out.append(f"verdict_on_smoke: {where} says {c['verdict']!r}")
        if c.get("unit") == "run" and c.get("runs", len(c.get("seeds", []))) < MIN_RUNS and c["verdict"] != NOT_RESOLVED:
            out.append(f"verdict_from_few_runs: {where} ({c.get('runs')} runs) says {c['verdict']!r}")
        if not isinstance(c.get("documents"), int) and c.get("independent") is not True:
            out.append(f"documents: {where} has no documents count and no 'independent' flag")
    for where, a in arms(report):
        if a.get("flops") is None and (a.get("cost") or {}).get("flops") is None:
            out.append(f"flops: {where} has no FLOPs")
    if markdown is not None:
        for m in PLACEHOLDER.finditer(markdown):
            out.append(f"placeholder: report.md has {m.group(0)!r}")
    return out


@pytest.fixture(scope="module")
def tiny_outputs(smoke_run):
    """Every smoke preset, each built once per session by the workflow that owns it (conftest's
    ``smoke_run``, shared with the workflow contract): ``(outputs folders, {preset: folder})``."""
    ran = {p: smoke_run(p) for p in smoke_presets()}
    return sorted(set(ran.values())), ran


def test_every_tiny_preset_is_found_and_runs(tiny_outputs):
    outs, ran = tiny_outputs
    assert {"tiny", "local_tiny", "distill_tiny", "library_tiny", "heal_topk_tiny", "study_tiny"} <= set(ran)
    assert all(p.is_dir() for p in outs), ran


def test_every_report_of_every_tiny_preset_keeps_the_contract(tiny_outputs):
    outs, _ = tiny_outputs
    reports = sorted((out, p) for out in outs for p in out.rglob("report.json") if ".partial" not in str(p))
    kinds = {p.parent.parent.name for _, p in reports}
    assert {"Evaluate", "DistillStudyReport", "LibraryReport", "LocalStudyReport", "ObjectiveStudyReport"} <= kinds, kinds
    bad, n_comp = [], 0
    for out, p in reports:
        rep = json.loads(p.read_text())
        md = p.with_name("report.md")
        bad += [f"{p.relative_to(out)}: {v}" for v in violations(rep, md.read_text() if md.is_file() else None, smoke=True)]
        n_comp += sum(1 for _ in comparisons(rep))
    assert n_comp >= 10 and not bad, "\n".join(bad)


def test_a_broken_report_fails_each_rule_by_name():
    good = {"a": "x", "b": "y", "verdict": NOT_RESOLVED, "unit": "run", "runs": 1, "documents": 12}
    assert violations({"comparisons": [good], "arms": [{"name": "x", "flops": {"total": 1}}]}, "Teacher `tiny`", True) == []
    broken = {"comparisons": [{"a": "x", "b": "y", "verdict": "a better", "unit": "run", "runs": 2}],
              "arms": [{"name": "x", "ce": 1.0}]}
    got = violations(broken, "Teacher `{report['teacher']}`; p {p:.3g}", smoke=True)
    assert {v.split(":")[0] for v in got} == {"verdict_on_smoke", "verdict_from_few_runs", "documents", "flops", "placeholder"}
    assert sum(v.startswith("placeholder") for v in got) == 2


def direct_compare_calls(paths) -> list[str]:
    """``"<file>:<line>"`` of every call of ``zgcore.evaluation.compare.compare`` outside the entry
    point (imported as ``compare`` from that module, or called as ``compare.compare``)."""
    import ast

    out = []
    for p in paths:
        tree = ast.parse(Path(p).read_text())
        names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                 and n.module == "zgcore.evaluation.compare" for a in n.names if a.name == "compare"}
        for n in ast.walk(tree):
            if isinstance(n, ast.Call):
                f = n.func
                if (isinstance(f, ast.Name) and f.id in names) or (
                        isinstance(f, ast.Attribute) and f.attr == "compare" and isinstance(f.value, ast.Name)
                        and f.value.id == "compare"):
                    out.append(f"{p}:{n.lineno}")
    return out


def test_every_report_compares_through_the_one_entry_point(tmp_path):
    """Reports call ``compare_arms`` (which knows fixed models from trained configurations), never
    ``compare`` itself: discovered over every module of zgcore/, tasks/, workflows/ and scripts/."""
    root = PRESETS.parents[1]
    files = [p for d in ("zgcore", "tasks", "workflows", "scripts") for p in (root / d).rglob("*.py")
             if p != root / "zgcore" / "evaluation" / "compare.py"]
    assert len(files) > 50 and direct_compare_calls(files) == []
    bad = tmp_path / "bad_report.py"
    bad.write_text("from zgcore.evaluation.compare import compare\n\ndef f(a, b):\n    return compare('a', 'b', [a], [b], [0])\n")
    assert direct_compare_calls([bad]) == [f"{bad}:4"]
