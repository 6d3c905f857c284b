"""Corpus sources: which files a ``corpus.source`` names, checking them before any work, and
reading their documents one at a time (never the whole corpus into memory).

``corpus.source`` is ``"pydoc"`` (the standard library's English reference text,
``pydoc_data.topics``), ``"python-stdlib"`` (the standard library's own ``.py`` files, ~30 MB),
``"stdlib-docstrings"`` (the docstrings of :data:`DOCSTRING_MODULES`, ~85k characters: API
documentation, out of the domain of ``pydoc``'s language reference; ``eval.extra``'s default), or
one path / glob or a list of them. A path is a text file, a ``.jsonl`` file (each record's
``text_field``), a ``.parquet`` file (its ``text_field`` column, read with pyarrow) or a folder
written by ``datasets.save_to_disk`` (its ``text_field`` column, read with datasets).

Files matched through a glob (and the stdlib's files) that are empty or unreadable are skipped with
one warning line each and counted; a file named explicitly must be usable.
"""
from __future__ import annotations

import glob
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Mapping

from zgcore.checks import ConfigError

BUILTIN = ("pydoc", "python-stdlib", "stdlib-docstrings")
# stdlib-docstrings: these modules' docstrings (module, classes, functions), in this order; a module
# this Python lacks is left out (the text depends on the Python version, as python-stdlib's does)
DOCSTRING_MODULES = ("collections/__init__", "contextlib", "csv", "dataclasses", "fractions", "functools", "heapq",
                     "json/__init__", "pprint", "random", "shutil", "string", "tempfile", "textwrap", "uuid")
_GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class Entry:
    """One file or dataset folder of a corpus. ``explicit``: named as such (not through a glob)."""

    path: Path
    explicit: bool

    @property
    def kind(self) -> str:
        """``"dataset"`` (a ``save_to_disk`` folder), ``"parquet"``, ``"jsonl"`` or ``"text"``."""
        if self.path.is_dir():
            return "dataset"
        return {".parquet": "parquet", ".jsonl": "jsonl"}.get(self.path.suffix, "text")


def stdlib_root() -> Path:
    """The folder of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's non-empty ``.py`` files, sorted by path relative to
    :func:`stdlib_root` (installed packages, caches and empty ``__init__.py`` files excluded): a
    deterministic order on a given Python version."""
    root = stdlib_root()
    skip = {"site-packages", "dist-packages", "__pycache__"}
    rel = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                 if not skip & set(p.relative_to(root).parts) and p.stat().st_size > 0)
    return [root / r for r in rel]


def module_docstrings(path: Path) -> str:
    """Every docstring of one Python source file (module, classes, functions, in source order),
    cleaned by :func:`ast.get_docstring` and separated by blank lines; "" when it has none.

    Raises:
        SyntaxError: the file is not Python this interpreter parses.
    """
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = [(getattr(n, "lineno", 0), ast.get_docstring(n)) for n in ast.walk(tree)
             if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    return "\n\n".join(d for _, d in sorted(found, key=lambda x: x[0]) if d)


def docstring_files() -> list[Path]:
    """The files of :data:`DOCSTRING_MODULES` this Python has, in that order."""
    root = stdlib_root()
    return [root / f"{m}.py" for m in DOCSTRING_MODULES if (root / f"{m}.py").is_file()]


def entries(corpus: Mapping[str, Any]) -> list[Entry]:
    """Expand ``corpus.source`` into entries in a deterministic order ([] for pydoc and stdlib-docstrings).

    Raises:
        ConfigError: an empty source list, a pattern that matches nothing.
    """
    src = corpus["source"]
    if src in ("pydoc", "stdlib-docstrings"):
        return []
    if src == "python-stdlib":
        return [Entry(p, False) for p in stdlib_files()]
    items = [src] if isinstance(src, str) else list(src)
    if not items:
        raise ConfigError("corpus.source is empty: give 'pydoc', 'python-stdlib' or files / globs / "
                          ".jsonl / .parquet files / a datasets.save_to_disk folder")
    out: list[Entry] = []
    for item in items:
        pattern = os.path.expanduser(str(item))
        explicit = not _GLOB_CHARS & set(pattern)
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise ConfigError(f"corpus.source: {item!r} matches no file")
        for m in map(Path, matches):
            if m.is_file() or (m.is_dir() and _is_saved_dataset(m)):
                out.append(Entry(m, explicit))
            elif explicit and m.is_dir():
                raise ConfigError(f"corpus.source: {m} is a folder but not one written by datasets.save_to_disk; "
                                  "give files or a glob such as 'folder/*.txt'")
    return out


def _is_saved_dataset(p: Path) -> bool:
    return (p / "state.json").is_file() or (p / "dataset_dict.json").is_file()


def check(corpus: Mapping[str, Any]) -> list[Entry]:
    """Check a corpus source cheaply (file sizes, Parquet / dataset schemas; no text is read) and
    return its entries ([] for the built-in sources, which need no check).

    Raises:
        ConfigError: an explicitly named file that is empty, a Parquet file or saved dataset
            without the ``text_field`` column (naming file and column), or no usable file at all.
    """
    if corpus["source"] in BUILTIN:
        return []
    ents = entries(corpus)
    field = corpus["text_field"]
    usable, reasons = 0, []
    for e in ents:
        problem = empty_reason(e, field)
        if problem is None:
            usable += 1
        elif problem.startswith(("has no column", "has no field")) or e.explicit:
            raise ConfigError(f"corpus.source: {e.path} {problem}")
        else:
            reasons.append(f"{e.path.name} {problem}")
    if not usable:
        shown = "; ".join(reasons[:3]) + (f"; and {len(reasons) - 3} more" if len(reasons) > 3 else "")
        raise ConfigError(f"corpus.source: none of the {len(ents)} matched file(s) is usable ({shown})")
    return ents


HEADER_BYTES = 1 << 16  # bytes of a text file decoded at graph build to check its encoding


def empty_reason(e: Entry, field: str) -> str | None:
    """Why entry ``e`` holds no usable data (``"is empty"``, ``"has no rows"``, ``"has no column
    ..."``, ``"has no field ... in its first record"``, ``"is not UTF-8 text ..."``), or None.
    Reads only sizes, schemas and file headers: the first :data:`HEADER_BYTES` of a text file,
    the first record of a ``.jsonl`` file. A problem further into a file is found while
    tokenising (the task then fails with one ``error:`` line naming the file)."""
    if e.kind == "dataset":
        ds = _load_dataset(e.path)
        if field not in ds.column_names:
            return f"has no column {field!r} (columns: {', '.join(ds.column_names)}); set corpus.text_field"
        return None if len(ds) else "has no rows"
    if e.path.stat().st_size == 0:
        return "is empty"
    if e.kind == "parquet":
        import pyarrow.parquet as pq

        try:
            meta = pq.ParquetFile(e.path).metadata
        except Exception as err:  # not a Parquet file: reported when it is read
            return None if e.explicit is False else f"cannot be read as Parquet ({err})"
        names = meta.schema.names
        if field not in names:
            return f"has no column {field!r} (columns: {', '.join(names)}); set corpus.text_field"
        return None if meta.num_rows else "has no rows"
    if e.kind == "jsonl":
        return _first_record_problem(e.path, field)
    return _encoding_problem(e.path)


def _encoding_problem(path: Path) -> str | None:
    """Why the first :data:`HEADER_BYTES` of ``path`` are not UTF-8 text, or None."""
    import codecs

    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
        final = not f.read(1)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=final)  # a character cut at the end is fine
    except UnicodeDecodeError as err:
        return (f"is not UTF-8 text (byte 0x{head[err.start]:02x} at offset {err.start}); convert it, "
                "e.g. iconv -f latin1 -t utf-8")
    return None


def _first_record_problem(path: Path, field: str) -> str | None:
    """Why the first non-blank line of JSONL file ``path`` is not a JSON object holding ``field``, or None."""
    with open(path, "rb") as f:
        first = next(((n, raw) for n, raw in enumerate(f, 1) if raw.strip()), None)
    if first is None:
        return "holds only blank lines"
    n, raw = first
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        return f"line {n} is not a UTF-8 JSON record ({str(err).splitlines()[0]})"
    if not isinstance(rec, dict):
        return f"line {n} is not a JSON object"
    if field not in rec:
        return (f"has no field {field!r} in its first record (line {n}; fields: {', '.join(map(str, rec)) or 'none'}); "
                "set corpus.text_field")
    return None


def _load_dataset(path: Path):
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):  # every split, in sorted split order
        ds = datasets.concatenate_datasets([ds[k] for k in sorted(ds)])
    return ds


def documents(corpus: Mapping[str, Any], piece_chars: int, skipped: list[dict[str, str]],
              log: Callable[[str], None] = print,
              counts: dict[str, int] | None = None) -> Iterator[tuple[str, bool, Iterator[tuple[str, str, bool]]]]:
    """Yield ``(source_name, explicit, docs)`` per source file; ``docs`` yields ``(name, text, last)``
    lazily, ``last`` marking the end of a document.

    A text file longer than ``piece_chars`` characters (if > 0) comes in pieces cut at line ends (one
    document, so no text of more than about ``piece_chars`` characters is held). Files that hold no
    data are skipped here (explicitly named ones were refused by :func:`check`), with a warning
    and a record in ``skipped``. An error while reading raises :class:`ConfigError` from ``docs``;
    the caller skips the file (when not ``explicit``) or fails. ``counts["sources"]`` (when given) is
    set to the number of sources before the first is read, so that a caller that stops early (at
    ``corpus.max_tokens``) can say how many were never opened.
    """
    field = corpus["text_field"]
    counts = {} if counts is None else counts
    if corpus["source"] == "pydoc":
        from pydoc_data.topics import topics

        counts["sources"] = 1
        yield "pydoc", True, ((f"pydoc:{k}", topics[k], True) for k in sorted(topics))
        return
    if corpus["source"] == "stdlib-docstrings":
        counts["sources"] = 1
        yield "stdlib-docstrings", True, ((f"docstrings:{p.relative_to(stdlib_root()).with_suffix('').as_posix()}",
                                       module_docstrings(p), True) for p in docstring_files())
        return
    found = entries(corpus) if corpus["source"] in BUILTIN else check(corpus)
    counts["sources"] = len(found)
    for e in found:
        reason = empty_reason(e, field)
        if reason is not None:
            log(f"warning: skipping corpus file {e.path}: it {reason}")
            skipped.append({"file": str(e.path), "reason": reason})
            continue
        yield str(e.path), e.explicit, _read(e, field, piece_chars)


def _read(e: Entry, field: str, piece_chars: int) -> Iterator[tuple[str, str]]:
    try:
        if e.kind == "parquet":
            import pyarrow.parquet as pq

            n = 0
            for batch in pq.ParquetFile(e.path).iter_batches(columns=[field], batch_size=256):
                for text in batch.column(0).to_pylist():
                    n += 1
                    yield f"{e.path}:{n}", "" if text is None else str(text), True
        elif e.kind == "dataset":
            for n, text in enumerate(_load_dataset(e.path).select_columns([field]).iter(batch_size=256)):
                for j, t in enumerate(text[field]):
                    yield f"{e.path}:{n * 256 + j + 1}", "" if t is None else str(t), True
        elif e.kind == "jsonl":
            with open(e.path, encoding="utf-8") as f:
                for n, line in enumerate(f):
                    if line.strip():
                        rec = json.loads(line)
                        if field not in rec:
                            raise ConfigError(f"{e.path}:{n + 1} has no {field!r} field")
                        yield f"{e.path}:{n + 1}", str(rec[field]), True
        else:
            with open(e.path, encoding="utf-8") as f:
                piece = _next_piece(f, piece_chars)
                while piece:
                    after = _next_piece(f, piece_chars)
                    yield str(e.path), piece, not after
                    piece = after
    except (UnicodeDecodeError, json.JSONDecodeError, OSError) as err:
        raise ConfigError(f"corpus file {e.path} cannot be read as text: {err}") from err
    except ConfigError:
        raise
    except Exception as err:  # pyarrow / datasets errors
        raise ConfigError(f"corpus file {e.path} cannot be read: {type(err).__name__}: {err}") from err


def _next_piece(f, piece_chars: int) -> str:
    """Up to about ``piece_chars`` characters of text file ``f``, ending at a line end (all of it
    when ``piece_chars <= 0``)."""
    text = f.read(piece_chars if piece_chars > 0 else -1)
    if 0 < piece_chars == len(text):
        text += f.readline()
    return text
