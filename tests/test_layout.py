"""The house rules of the code layout: no import circle among the modules of ``zgcore/``,
``tasks/``, ``workflows/``, ``bench/`` and ``scripts/`` (data flows workflows -> tasks -> zgcore, and
inside each a module imports only modules below it); ``zgcore/``'s subpackages are layers that import only the layers below them (the order in
``zgcore/__init__.py``'s docstring); at most a dozen modules left at the top of ``zgcore/``; and no
module of ``zgcore/``, ``tasks/`` or ``workflows/`` longer than 400 lines.

Imports are read from the source with :mod:`ast` (every ``import`` statement in the file: top-level,
inside functions (lazy), relative and absolute), so a circle hidden in a lazy import counts too.
"""
from __future__ import annotations

from pathlib import Path

from tasks.versions import ROOT, import_graph, imports, modules  # one reader of the import graph (the code guard's)

HOUSE = ("zgcore", "tasks", "workflows", "bench", "scripts")  # every folder of our code: no import circle in any

MAX_LINES = 400
# zgcore's layers, lowest first: a module may import the top-level utilities, its own layer and the
# layers before it in this list (zgcore/__init__.py says what each holds).
LAYERS = ("models", "data", "training", "evaluation", "config", "local")
MAX_TOP_MODULES = 12


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


def house_modules() -> dict[str, Path]:
    """``{dotted module name: file}`` of every .py under :data:`HOUSE` (a package is its ``__init__.py``;
    a folder without one, ``scripts/``, is a namespace package)."""
    out = {}
    for pkg in HOUSE:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            out[".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = p
    return out


def house_graph() -> dict[str, set[str]]:
    """``{module: the house's modules it imports}`` over every folder of :data:`HOUSE`."""
    known = house_modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def test_no_import_circle_anywhere_in_the_house():
    graph = house_graph()
    for m in ("zgcore.config.experiment", "tasks.base", "workflows.cli", "bench.common", "scripts.golden"):
        assert m in graph, f"the checker did not find {m}"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_circle_checker_sees_a_package_and_its_submodule_importing_each_other(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from . import B\n")  # a name the package defines: the package itself
    known = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py"}
    graph = {m: imports(m, p, known) for m, p in known.items()}
    assert find_cycle(graph) == ["pkg", "pkg.a", "pkg"]


def test_zgcore_never_imports_tasks_or_workflows():
    graph = import_graph()
    for m, deps in graph.items():
        if m.startswith("zgcore"):
            assert not [d for d in deps if not d.startswith("zgcore")], f"{m} imports {deps}"


def layer_of(module: str) -> str | None:
    """The layer of a zgcore module (``zgcore.data.corpus`` -> ``data``), None for a top-level utility."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def layering_problems(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a zgcore module that goes up or sideways across the layers, one sentence each."""
    out = []
    for m, deps in sorted(graph.items()):
        if not m.startswith("zgcore.") :
            continue
        mine = layer_of(m)
        allowed = set(LAYERS[: LAYERS.index(mine) + 1]) if mine else set()
        for d in sorted(deps):
            theirs = layer_of(d)
            if d != "zgcore" and theirs is not None and theirs not in allowed:
                out.append(f"{m} ({mine or 'utility'}) imports {d} ({theirs})")
    return out


def test_the_layering_checker_sees_an_upward_import():
    graph = {"zgcore.data.corpus": {"zgcore.training.loop"}, "zgcore.training.loop": {"zgcore.data.order"},
             "zgcore.atomic": {"zgcore.models.teacher"}, "zgcore.models.teacher": {"zgcore.atomic"}}
    assert layering_problems(graph) == ["zgcore.atomic (utility) imports zgcore.models.teacher (models)",
                                        "zgcore.data.corpus (data) imports zgcore.training.loop (training)"]


def test_zgcore_subpackages_import_only_the_layers_below_them():
    graph = import_graph()
    assert set(LAYERS) <= {layer_of(m) for m in graph if m.startswith("zgcore.")}, "a layer has no module"
    problems = layering_problems(graph)
    assert not problems, "imports against the layering (zgcore/__init__.py):\n" + "\n".join(problems)


def test_few_modules_at_the_top_of_zgcore():
    top = sorted(p.name for p in (ROOT / "zgcore").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules at the top of zgcore/ (move them into a layer): {top}"
    layers = {p.name for p in (ROOT / "zgcore").iterdir() if (p / "__init__.py").is_file()}
    assert layers == set(LAYERS), f"zgcore's subpackages {sorted(layers)} are not the layers {LAYERS}"


def test_no_module_above_400_lines():
    files = list(modules().values()) + sorted((ROOT / "workflows").rglob("*.py"))
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules above {MAX_LINES} lines (split them by what they do): {long}"
