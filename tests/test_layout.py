"""The house rules of issue 21: no import circle among the modules of ``zgcore/`` and ``tasks/``
(data flows workflows -> tasks -> zgcore, and inside each a module imports only modules below it),
and no module there longer than 400 lines.

Imports are read from the source with :mod:`ast` (every ``import`` statement in the file: top-level,
inside functions (lazy), relative and absolute), so a circle hidden in a lazy import counts too.
"""
from __future__ import annotations

from tasks.versions import ROOT, import_graph, imports, modules  # one reader of the import graph (the code guard's)

MAX_LINES = 400


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
