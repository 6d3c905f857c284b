"""The code-version guard: every task family's ``code_version`` and a digest of the code that
decides its output (its own class and its ``code_deps``), recorded in ``tasks/code_versions.json``.

A task's hash covers its family's ``code_version``, so outputs computed by other code never share
a name. ``tests/test_code_versions.py`` fails when a family's code changed but its version did not;
after bumping it (or for a change that cannot alter any output, such as a rename), record the new
state with the one command::

    .venv/bin/python -m tasks.versions --write
"""
from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

RECORD = Path(__file__).with_name("code_versions.json")
COMMAND = "python -m tasks.versions --write"


def families() -> dict[str, type]:
    """Every concrete ZeroGraph task family, by name (classes whose name starts with ``_`` are bases)."""
    import tasks  # noqa: F401  (registers the experiment graph's and the study's tasks)
    import tasks.distill  # noqa: F401  (imported lazily elsewhere: every family is registered here, whatever ran before)
    import tasks.local  # noqa: F401
    import tasks.students  # noqa: F401
    from tasks.base import ZGTask

    out, todo = {}, list(ZGTask.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if not cls.__name__.startswith("_"):
            out[cls.get_task_family()] = cls
    return dict(sorted(out.items()))


def current() -> dict[str, dict]:
    """``{family: {"version", "digest", "code"}}`` of the code as it is now."""
    from zgcore.hashing import source_digest

    out = {}
    for name, cls in families().items():
        code = [f"{cls.__module__}:{cls.__qualname__}", *cls.code_deps]
        out[name] = {"version": int(cls.code_version), "digest": source_digest(code), "code": code}
    return out


def problems() -> list[str]:
    """What is out of step between the code and ``tasks/code_versions.json``, one sentence each."""
    recorded = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    out = []
    for name, now in current().items():
        was = recorded.get(name)
        cls = families()[name]
        where = Path(inspect.getsourcefile(cls)).name
        if was is None:
            out.append(f"{name} is not recorded: run `{COMMAND}`")
        elif now["digest"] != was["digest"] and now["version"] == was["version"]:
            out.append(f"{name}'s code ({', '.join(now['code'])}) changed but {name}.code_version is still "
                       f"{now['version']}: raise it to {now['version'] + 1} in tasks/{where} (its outputs and "
                       f"everything downstream get new names), then run `{COMMAND}`. If the change cannot alter "
                       "any output (a rename, a refactor), run the command without bumping.")
        elif now["digest"] != was["digest"] or now["version"] != was["version"] or now["code"] != was.get("code"):
            out.append(f"{name}: code_version {was['version']} -> {now['version']} is not recorded yet: run `{COMMAND}`")
    for name in sorted(set(recorded) - set(current())):
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
        print("\n".join(problems()) or "every task family's code matches its recorded version")
