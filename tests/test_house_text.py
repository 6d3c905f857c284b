"""What the house rules say of text, over everything that exists: no work-item number in a
docstring, a test's name or a docs anchor; the docs name the default data-feed worker the code
has; the docs name no code that is gone."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from zgcore.config.defaults import DEFAULTS

ROOT = Path(__file__).resolve().parents[1]
NUMBERED = re.compile(r"\b(?:[Ii]ssues?|[Ww]ork[- ]items?)\s*#?\d+|\bpart \d+ of (?:the )?issue|\(#\d+\)")
ANCHOR = re.compile(r"\]\([^)\s]*#([^)\s]+)\)")
GONE = ("code_deps", "workflow_of", "PRESET_OWNERS")  # names the code had and has no more


def numbered_docstrings(files) -> list[str]:
    """``file:line: text`` of every docstring or test name among ``files`` that cites a work item."""
    out = []
    for f in files:
        tree = ast.parse(Path(f).read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                name = getattr(node, "name", "")
                for text in (doc, name.replace("_", " ")):
                    if NUMBERED.search(text):
                        out.append(f"{f}:{getattr(node, 'lineno', 1)}: {NUMBERED.search(text).group(0)}")
    return out


def test_no_work_item_number_in_a_docstring_or_a_test_name():
    files = [p for d in ("zgcore", "tasks", "workflows", "tests", "bench", "scripts") for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 100
    assert numbered_docstrings(files) == []


def test_the_docstring_check_sees_a_work_item_number(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text('"""Issue 14: a sweep."""\ndef test_issue_7_holds():\n    """Fine."""\n')
    assert numbered_docstrings([f]) == [f"{f}:1: Issue 14", f"{f}:2: issue 7"]


def numbered_anchors(text: str) -> list[str]:
    """Every link anchor in a Markdown text that carries a work-item number (``#...-issue-18``)."""
    return [a for a in ANCHOR.findall(text) if re.search(r"(?:^|-)(?:issue|item|part)-?\d+", a)]


def test_no_docs_anchor_carries_a_work_item_number():
    assert numbered_anchors("see [x](../bench/README.md#the-input-pipeline-issue-18)") == ["the-input-pipeline-issue-18"]
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
    bad = {str(p.relative_to(ROOT)): a for p in pages if (a := numbered_anchors(p.read_text()))}
    assert not bad, bad


def test_the_docs_name_the_default_worker_the_code_has():
    mode = DEFAULTS["train"]["prefetch_mode"]
    text = " ".join((ROOT / "docs" / "performance.md").read_text().split())
    claims = set(re.findall(r"default (thread|process|auto) worker", text)) | \
        set(re.findall(r"\*\*`(thread|process|auto)`\*\* \(default\)", text))
    assert claims == {mode}, f"docs/performance.md calls {claims} the default worker; the code's is {mode!r}"


def test_the_docs_name_no_code_that_is_gone():
    for name in GONE:
        assert not list(ROOT.glob(f"*/**/{name}.py"))
        for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
            lines = [ln for ln in p.read_text().splitlines() if f"`{name}`" in ln and "gone" not in ln]
            assert not lines, f"{p.relative_to(ROOT)} names `{name}`, which the code no longer has: {lines}"


# a literal "+" before a float field without a sign of its own prints "+-0.0027" for a negative value
PLUS_BEFORE_FIELD = re.compile(r"\+\{[^{}:]*:[^+{}]*f\}")


def plus_before_a_field(files) -> list[str]:
    """``file:line`` of each f-string that writes a literal ``+`` before an unsigned float field."""
    return [f"{f}:{n}" for f in files for n, line in enumerate(Path(f).read_text().splitlines(), 1)
            if PLUS_BEFORE_FIELD.search(line)]


def test_signed_differences_print_their_own_sign():
    files = [p for d in ("zgcore", "tasks", "workflows", "bench", "scripts") for p in sorted((ROOT / d).rglob("*.py"))]
    assert plus_before_a_field(files) == []


def test_the_sign_check_sees_a_literal_plus(tmp_path):
    f = tmp_path / "x.py"
    f.write_text('print(f"(+{d:.4f} nats)")\nprint(f"({d:+.4f} nats) {a}+{b}")\n')
    assert plus_before_a_field([f]) == [f"{f}:1"]
