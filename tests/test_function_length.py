"""Functions stay short enough to read in one screen: at most :data:`MAX_LONG` functions of zgcore/,
tasks/ and workflows/ run over :data:`LIMIT` lines (docstrings not counted), and none of tasks/
does (a task reads its inputs, makes one zgcore call and writes its outputs)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("zgcore", "tasks", "workflows")
LIMIT = 60  # lines of a function, its docstrings excluded
MAX_LONG = 8  # functions over LIMIT allowed across PACKAGES (none in tasks/)


def _docstring_lines(node: ast.AST) -> set[int]:
    """The line numbers of every docstring inside ``node`` (its own and its nested functions' and classes')."""
    out: set[int] = set()
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and n.body:
            first = n.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out.update(range(first.lineno, first.end_lineno + 1))
    return out


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """``(qualified name, first line, length)`` of every function in ``source``: its lines from
    ``def`` to its last, less the lines of the docstrings inside it."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = set(range(child.lineno, child.end_lineno + 1))
                out.append((prefix + child.name, child.lineno, len(span - _docstring_lines(child))))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def long_functions(root: Path = ROOT) -> list[str]:
    """``"<path>:<name> (<n> lines)"`` of every function of :data:`PACKAGES` over :data:`LIMIT` lines."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            for name, _, n in function_lengths(path.read_text()):
                if n > LIMIT:
                    out.append(f"{path.relative_to(root)}:{name} ({n} lines)")
    return out


def test_few_long_functions_and_none_in_tasks():
    found = long_functions()
    print(f"functions over {LIMIT} lines:", *found, sep="\n  ")
    assert not [f for f in found if f.startswith("tasks/")], f"a task's function runs over {LIMIT} lines: {found}"
    assert len(found) <= MAX_LONG, f"{len(found)} functions over {LIMIT} lines (at most {MAX_LONG}): {found}"


def test_the_checker_counts_code_not_docstrings(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))  # LIMIT lines of code + the def line
    doc = '    """' + "\n" * 30 + '    """\n'
    assert function_lengths(f"def f():\n{doc}{body}\n") == [("f", 1, LIMIT + 1)]
    assert function_lengths(f"def f():\n{doc}{body[:-len('    x59 = 59') - 1]}\n")[0][2] == LIMIT
    (tmp_path / "tasks").mkdir()
    (tmp_path / "zgcore").mkdir()
    (tmp_path / "workflows").mkdir()
    nested = (doc + body).replace("\n    ", "\n        ")
    (tmp_path / "tasks" / "broken.py").write_text(f"class T:\n    def run(self):\n    {nested}\n")
    assert long_functions(tmp_path) == [f"tasks/broken.py:T.run ({LIMIT + 1} lines)"]
