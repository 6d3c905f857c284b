"""One spelling for a local path before it enters a hash: ``teacher=../models/mistral``,
``~/models/mistral`` and ``/home/me/models/mistral`` name one ``PrepareTeacher`` folder, not three.

A task's hash covers its configuration's canonical values (:mod:`zgcore.hashing`); a path is canonical
here when it is absolute, ``~`` expanded and its symlinks resolved (:meth:`pathlib.Path.resolve`).
What the files hold stays visible through the size-and-time stamp the tasks hash beside the path
(``tasks`` ``path_stamp``), so an edited file still rebuilds what depends on it.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any



def canonical_path(spec: str) -> str:
    """``spec`` made canonical when it names an existing local file or folder (a Hugging Face folder,
    a ``.gguf``, a corpus file), else returned unchanged: a built-in name (``smollm2-135m``,
    ``tiny-llama``, ``pydoc``), a Hub id (``org/name``), or a path that does not exist (the
    configuration check then names it as the user spelled it).

    A glob (``~/texts/*.txt``) keeps its pattern; the folders before its first wildcard are made canonical.
    """
    from zgcore.data.sources import BUILTIN

    s = str(spec)
    if s in BUILTIN:
        return s
    expanded = os.path.expanduser(s)
    if glob.has_magic(expanded):
        parts = Path(expanded).parts
        cut = next(i for i, part in enumerate(parts) if glob.has_magic(part))
        fixed = Path(*parts[:cut]) if cut else Path(".")
        if not fixed.is_dir():
            return s
        return str(fixed.resolve().joinpath(*parts[cut:]))
    p = Path(expanded)
    return str(p.resolve()) if p.exists() else s


def canonical_source(source: Any) -> Any:
    """``corpus.source`` (one entry or a list) with every local path made canonical (:func:`canonical_path`)."""
    if isinstance(source, (list, tuple)):
        return [canonical_path(x) if isinstance(x, (str, os.PathLike)) else x for x in source]
    return canonical_path(source) if isinstance(source, (str, os.PathLike)) else source
