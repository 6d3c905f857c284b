"""The code-version guard: every task family's ``code_version`` and a digest of the code that
decides its output, recorded in ``tasks/code_versions.json``.

The code of a family is derived, never listed by hand: the module that defines its class and,
transitively, every module of ``zgcore/`` and ``tasks/`` it imports — top-level and lazy imports
alike, read from the source with :mod:`ast` (:func:`closure`) — plus the ``__init__.py`` of every
package on the way (run on import). Each module counts by its syntax tree (comments, docstrings
and layout do not). Where a class lives does not matter: moving one moves its closure with it.

A task's hash covers its family's ``code_version``, so outputs computed by other code never share
a name. ``tests/test_code_versions.py`` (and ``python -m tasks.versions``, exit 1) fails when a
family's code changed but its version did not, naming the modules that changed; after bumping it
(or for a change that cannot alter any output, such as a rename), record the new state with the
one command::

    .venv/bin/python -m tasks.versions --write
"""
from __future__ import annotations

import ast
import hashlib
import inspect
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = Path(__file__).with_name("code_versions.json")
COMMAND = "python -m tasks.versions --write"
PACKAGES = ("zgcore", "tasks")
_PARSED: dict[str, str] = {}  # sha256 of a module's text -> its code digest (this process)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """``{dotted module name: file}`` of every .py under :data:`PACKAGES` (a package is its ``__init__.py``)."""
    out = {}
    for pkg in PACKAGES:
        for p in sorted((root / pkg).rglob("*.py")):
            name = ".".join(p.relative_to(root).with_suffix("").parts)
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


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: modules of zgcore/ and tasks/ it imports}`` (see :func:`imports`)."""
    known = modules(root)
    return {m: imports(m, p, known) for m, p in known.items()}


def closure(start: str, root: Path = ROOT, graph: dict[str, set[str]] | None = None) -> list[str]:
    """Every module of ``zgcore/`` and ``tasks/`` that importing and running ``start`` can execute:
    ``start``, what it imports (transitively, lazy imports included), and the packages above each
    (their ``__init__.py`` runs first; their own imports count only when imported themselves). Sorted."""
    graph = import_graph(root) if graph is None else graph
    known = set(graph)
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m in seen or m not in known:
            continue
        seen.add(m)
        todo += sorted(graph[m])
    parents = {".".join(m.split(".")[:i]) for m in seen for i in range(1, m.count(".") + 1)}
    return sorted(seen | (parents & known))


def families() -> dict[str, type]:
    """Every concrete ZeroGraph task family of this project, by name (classes whose name starts with
    ``_`` are bases; a class defined outside ``tasks/`` and ``workflows/``, a test's dummy, is not
    the project's and has no recorded code version)."""
    import pkgutil

    import tasks
    from tasks.base import ZGTask

    for mod in pkgutil.iter_modules(tasks.__path__):  # every task module, whatever was imported before
        __import__(f"tasks.{mod.name}")
    out, todo = {}, list(ZGTask.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if not cls.__name__.startswith("_") and cls.__module__.split(".")[0] in ("tasks", "workflows"):
            out[cls.get_task_family()] = cls
    return dict(sorted(out.items()))


def current(root: Path = ROOT) -> dict[str, dict]:
    """``{family: {"version", "digest", "code": {module: digest}}}`` of the code under ``root`` as it
    is now (``root`` is the repository; a copy of it in tests)."""
    from zgcore.hashing import code_digest

    known, graph = modules(root), import_graph(root)
    digests: dict[str, str] = {}
    out = {}
    for name, cls in families().items():
        code = {}
        for m in closure(cls.__module__, root, graph):
            if m not in digests:
                text = known[m].read_text()
                key = hashlib.sha256(text.encode()).hexdigest()  # parsing is the slow part: once per text
                if key not in _PARSED:
                    _PARSED[key] = code_digest(text, str(known[m]))
                digests[m] = _PARSED[key]
            code[m] = digests[m][:16]
        digest = hashlib.sha256(json.dumps(code, sort_keys=True).encode()).hexdigest()
        out[name] = {"version": int(cls.code_version), "digest": digest, "code": code}
    return out


def problems(recorded: dict | None = None, root: Path = ROOT) -> list[str]:
    """What is out of step between the code under ``root`` and ``recorded`` (default: ``tasks/code_versions.json``), one sentence each."""
    if recorded is None:
        recorded = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    now_all, fams, known, out = current(root), families(), modules(root), []

    def file_of(m: str) -> str:
        return known[m].relative_to(root).as_posix() if m in known else m.replace(".", "/") + ".py"

    for name, now in now_all.items():
        was = recorded.get(name)
        where = Path(inspect.getsourcefile(fams[name])).name
        if was is None:
            out.append(f"{name} is not recorded: run `{COMMAND}`")
            continue
        old = was.get("code") if isinstance(was.get("code"), dict) else {}
        changed = sorted(m for m in set(now["code"]) | set(old) if now["code"].get(m) != old.get(m))
        what = ", ".join(file_of(m) for m in changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
        if now["digest"] != was["digest"] and now["version"] == was["version"]:
            out.append(f"{name}'s code changed ({what or 'its module list'}) but {name}.code_version is still "
                       f"{now['version']}: raise it to {now['version'] + 1} in tasks/{where} (its outputs and "
                       f"everything downstream get new names), then run `{COMMAND}`. If the change cannot alter "
                       "any output (a rename, a refactor), run the command without bumping.")
        elif now["digest"] != was["digest"] or now["version"] != was["version"]:
            out.append(f"{name}: code_version {was['version']} -> {now['version']} is not recorded yet: run `{COMMAND}`")
    for name in sorted(set(recorded) - set(now_all)):
        out.append(f"{name} is recorded but no longer exists: run `{COMMAND}`")
    return out


def write() -> None:
    """Record the code as it is now in ``tasks/code_versions.json``."""
    RECORD.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
        print(f"recorded {len(current())} task families in {RECORD}")
    else:
        found = problems()
        print("\n".join(found) or "every task family's code matches its recorded version")
        sys.exit(1 if found else 0)
