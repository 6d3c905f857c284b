"""The house rules of issue 21: no import circle among the modules of ``zgcore/`` and ``tasks/``
(data flows workflows -> tasks -> zgcore, and inside each a module imports only modules below it),
and no module there longer than 400 lines.

Imports are read from the source with :mod:`ast` (every ``import`` statement in the file: top-level,
inside functions (lazy), relative and absolute), so a circle hidden in a lazy import counts too.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("zgcore", "tasks")
MAX_LINES = 400


def modules() -> dict[str, Path]:
    """``{dotted module name: file}`` of every .py under :data:`PACKAGES` (a package is its ``__init__.py``)."""
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that the file ``path`` (module ``name``) imports anywhere in its body.

    ``from a.b import c`` names ``a.b.c`` when that is a module, else ``a.b``; relative imports are
    resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in known:
                    out.add(full)
                elif base in known:
                    out.add(base)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")  # `import a.b.c` imports a, a.b and a.b.c: the deepest one we know
                for n in range(len(parts), 0, -1):
                    if ".".join(parts[:n]) in known:
                        out.add(".".join(parts[:n]))
                        break
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """``{module: modules it imports}`` over :data:`PACKAGES`."""
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_checker_sees_lazy_relative_and_absolute_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import thing\n")
    (pkg / "b.py").write_text("def f():\n    import pkg.c\n")
    (pkg / "c.py").write_text("def g():\n    from pkg import a\n")
    known = {"pkg": pkg / "__init__.py", **{f"pkg.{m}": pkg / f"{m}.py" for m in "abc"}}
    graph = {m: imports(m, p, known) for m, p in known.items()}
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("")
    graph["pkg.c"] = imports("pkg.c", pkg / "c.py", known)
    assert find_cycle(graph) is None


def test_no_import_circle_in_zgcore_and_tasks():
    graph = import_graph()
    assert {"zgcore.config", "tasks.base"} <= set(graph), "the checker found none of the modules"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_zgcore_never_imports_tasks_or_workflows():
    graph = import_graph()
    for m, deps in graph.items():
        if m.startswith("zgcore"):
            assert not [d for d in deps if not d.startswith("zgcore")], f"{m} imports {deps}"


def test_no_module_above_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules above {MAX_LINES} lines (split them by what they do): {long}"
