"""The configuration reference, ``docs/configuration.md``, generated from the code that defines the
keys, so that it cannot drift: the values come from the default mappings themselves
(:data:`zgcore.config.defaults.DEFAULTS`, :data:`zgcore.local.config.LOCAL_DEFAULTS`), each key's meaning
from the comment written beside it (or on the lines just above it) in their source, read with
:mod:`ast` and :mod:`tokenize`, and the allowed values from :data:`zgcore.config.defaults.CHOICES`,
:data:`zgcore.local.config.LOCAL_CHOICES` and the objective registry.

Regenerate with ``.venv/bin/python -m workflows.reference --write`` (``tests/test_config_doc.py``
fails when the file is out of date). Follows the generated reference pages of DVC and Snakemake.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import io
import json
import sys
import tokenize
from pathlib import Path
from typing import Any, Iterator, Mapping

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
COMMAND = ".venv/bin/python -m workflows.reference --write"


def _comments(source: str) -> tuple[dict[int, str], dict[int, str]]:
    """``(trailing, whole_line)``: the text of comments at the end of a code line and of comment-only
    lines, by 1-based line number."""
    trailing, whole = {}, {}
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            text = tok.string.lstrip("#").strip()
            (whole if not lines[row - 1][:col].strip() else trailing)[row] = text
    return trailing, whole


class _Source:
    """One module's source: its top-level dict literals by name, and its comments."""

    def __init__(self, module: str):
        self.module = importlib.import_module(module)
        source = Path(self.module.__file__).read_text()
        self.trailing, self.whole = _comments(source)
        self.literals: dict[str, ast.Dict] = {}
        self.aliases: dict[str, str] = {}
        for node in ast.parse(source).body:
            if isinstance(node, ast.ImportFrom):
                self.aliases.update({a.asname: a.name for a in node.names if a.asname})
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            if isinstance(target, ast.Name) and isinstance(getattr(node, "value", None), ast.Dict):
                self.literals[target.id] = node.value


def _meaning(src: _Source, key: ast.expr, value: ast.expr, taken: int = 0) -> str:
    """The comment at the end of the entry's last line (else its first line), then the comment lines
    directly above it (a note on a group of keys), joined. A comment at the end of line ``taken``
    belongs to the enclosing entry (``"u": {"x": 0},  # note`` describes ``u``, not ``u.x``)."""
    above, row = [], key.lineno - 1
    while row in src.whole:
        above.insert(0, src.whole[row])
        row -= 1
    after = next((src.trailing[r] for r in (value.end_lineno, key.lineno) if r in src.trailing and r != taken), "")
    return " — ".join(x for x in (after, " ".join(above)) if x)


def _describe(node: ast.expr, sources: list[_Source], src: _Source, prefix: str, out: dict[str, str],
              taken: int = 0) -> None:
    """Fill ``out`` (dotted key -> meaning) from a dict literal, following ``**NAME`` spreads,
    ``NAME`` and ``NAME["section"]`` values to the literals they name in ``sources``."""
    if isinstance(node, ast.Dict):
        for k, v in zip(node.keys, node.values):
            if k is None:  # **spread: the spread mapping's meanings, overridden by later entries
                _describe(v, sources, src, prefix, out, taken)
                continue
            name = f"{prefix}{k.value}"
            if _meaning(src, k, v, taken):
                out[name] = _meaning(src, k, v, taken)
            _describe(v, sources, src, name + ".", out, v.end_lineno)
        return
    if isinstance(node, ast.Name) or (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)):
        ident = node.id if isinstance(node, ast.Name) else node.value.id
        ident = src.aliases.get(ident, ident)  # `from .x import DEFAULTS as _MAIN_DEFAULTS`
        for s in sources:
            if ident in s.literals:
                lit = s.literals[ident]
                if isinstance(node, ast.Subscript):
                    lit = next((v for k, v in zip(lit.keys, lit.values)
                                if k is not None and k.value == node.slice.value), None)
                if lit is not None:
                    _describe(lit, sources, s, prefix, out)
                return


def meanings(module: str, name: str, also: tuple[str, ...] = ()) -> dict[str, str]:
    """Dotted key -> the comment that explains it, for the dict literal ``name`` in ``module``
    (literals it spreads or names are looked up in ``module`` and the modules ``also``)."""
    sources = [_Source(m) for m in (module, *also)]
    out: dict[str, str] = {}
    _describe(sources[0].literals[name], sources, sources[0], "", out)
    return out


def flat(mapping: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` for every leaf of a nested mapping; a mapping value that is empty
    (``blocks``) is a leaf."""
    for k, v in mapping.items():
        if isinstance(v, Mapping) and v:
            yield from flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _value(v: Any) -> str:
    return "`" + json.dumps(v) + "`" if v is not None else "`null`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(defaults: Mapping[str, Any], means: Mapping[str, str], choices: Mapping[str, tuple]) -> list[str]:
    rows = ["| key | default | allowed values | meaning |", "|---|---|---|---|"]
    for key, v in flat(defaults):
        allowed = ", ".join(f"`{c}`" for c in choices.get(key, ()))
        rows.append(f"| `{key}` | {_cell(_value(v))} | {_cell(allowed)} | {_cell(means.get(key, ''))} |")
    return rows


def sections() -> list[tuple[str, str, dict[str, Any], dict[str, str], dict[str, tuple]]]:
    """``(title, introduction, defaults, meanings, choices)`` for each workflow's settings."""
    from zgcore.config import defaults
    from zgcore.local import config as local_config
    from zgcore.training.objectives import OBJECTIVES

    from .registry import workflows_of_schema

    main_choices = {**defaults.CHOICES, "train.objective": tuple(OBJECTIVES)}
    main, local = workflows_of_schema("experiment"), workflows_of_schema("local")
    return [
        (", ".join(main),
         "Read by " + ", ".join(f"`{w}`" for w in [*main, "PrepareInputs"]) + " (`zgcore/config/defaults.py`, `DEFAULTS`). "
         "Every `train.*` key can also be set for one block as `blocks.N.<key>`.",
         defaults.DEFAULTS, meanings("zgcore.config.defaults", "DEFAULTS"), main_choices),
        (", ".join(local),
         "Read by " + ", ".join(f"`{w}`" for w in local) + " (`zgcore/local/config.py`, `LOCAL_DEFAULTS`; presets `local_*`).",
         local_config.LOCAL_DEFAULTS,
         meanings("zgcore.local.config", "LOCAL_DEFAULTS", ("zgcore.config.defaults",)),
         local_config.LOCAL_CHOICES),
    ]


def markdown() -> str:
    """The whole reference page."""
    out = ["# Configuration reference", "",
           f"<!-- generated by `{COMMAND}` from the defaults' source; do not edit by hand -->", "",
           "Every key an experiment file (`--config`), an override (`--set key=value`) or a preset "
           "(`--preset`, `workflows/presets/`) may set, with its default. Unknown keys are errors. "
           "How to write a configuration: [config-guide.md](config-guide.md).", ""]
    for title, intro, defaults, means, choices in sections():
        out += [f"## {title}", "", intro, "", *_table(defaults, means, choices), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    """``python -m workflows.reference`` prints the page; ``--write`` writes ``docs/configuration.md``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    text = markdown()
    if args.write:
        DOC.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
