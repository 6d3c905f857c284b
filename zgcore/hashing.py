"""Canonical configuration hashing: one function names every output path; the canonical JSON form
(also the form every result file is written in, :func:`zgcore.atomic.write_json`); source digests
for the code-version guard.

Follows gokart's unique ids: a task's id is a hash of its own significant configuration and the
ids of its upstream tasks, so a change anywhere upstream moves every path downstream of it.
"""
from __future__ import annotations

import ast
import hashlib
import json
import math
import textwrap
from pathlib import PurePath
from typing import Any
from collections.abc import Iterable, Mapping

HASH_LEN = 12


def canonical(obj: Any, nonfinite: str = "raise") -> Any:
    """Return a JSON-ready canonical form of ``obj``.

    Mappings become dicts with string keys (key order is irrelevant once dumped with
    ``sort_keys``); tuples become lists; integral floats become ints so that ``1`` and ``1.0``
    hash alike; paths become strings.

    ``nonfinite``: ``"raise"`` (hashing: a NaN or infinity has no canonical form) or ``"null"``
    (writing results: a non-finite figure becomes ``null``, see :func:`zgcore.atomic.write_json`).

    Raises:
        TypeError: for values that have no canonical JSON form (e.g. arbitrary objects), or a
            non-finite float when ``nonfinite="raise"``.
    """
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isnan(obj) or math.isinf(obj):
            if nonfinite == "null":
                return None
            raise TypeError(f"cannot hash non-finite float {obj!r}")
        return int(obj) if obj.is_integer() else obj
    if isinstance(obj, Mapping):
        return {str(k): canonical(v, nonfinite) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [canonical(v, nonfinite) for v in obj]
    if isinstance(obj, PurePath):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return canonical(obj.item(), nonfinite)
    raise TypeError(f"cannot canonicalise {type(obj).__name__}: {obj!r}")


def canonical_json(obj: Any) -> str:
    """Serialise ``obj`` canonically (sorted keys, no whitespace). Returns a str."""
    return json.dumps(canonical(obj), sort_keys=True, separators=(",", ":"))


def config_hash(kind: str, config: Mapping[str, Any], upstream: Iterable[str] = ()) -> str:
    """Hash a task's identity: its kind, canonical config and ordered upstream hashes.

    Args:
        kind: the task family (e.g. ``"TrainBlock"``).
        config: the task's significant configuration.
        upstream: the hashes of the tasks it reads from, in a fixed order.

    Returns:
        The first ``HASH_LEN`` hex digits of a SHA-256 digest.
    """
    payload = canonical_json({"kind": kind, "config": config, "upstream": list(upstream)})
    return hashlib.sha256(payload.encode()).hexdigest()[:HASH_LEN]


def file_sha256(path: str | PurePath, chunk: int = 1 << 22) -> str:
    """SHA-256 hex digest of a file's bytes, read in ``chunk``-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# file_sha256_cached: (absolute path, size, mtime_ns, inode) -> SHA-256 hex, for this process
_SHA256_SEEN: dict[tuple, str] = {}


def _file_key(path: str | PurePath) -> tuple:
    import os

    st = os.stat(path)
    return os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ino


def file_sha256_cached(path: str | PurePath) -> str:
    """:func:`file_sha256` of ``path``, hashed once per process and version of the file (its size,
    modification time and inode): checking a finished output's content on every ``complete()``
    then costs one read per file and process. Raises ``OSError`` as reading does."""
    key = _file_key(path)
    if key not in _SHA256_SEEN:
        _SHA256_SEEN[key] = file_sha256(path)
    return _SHA256_SEEN[key]


def remember_sha256(path: str | PurePath, digest: str) -> None:
    """Record ``digest`` as the SHA-256 of ``path`` as it is now (what its writer just hashed), so
    that :func:`file_sha256_cached` does not read it again in this process."""
    _SHA256_SEEN[_file_key(path)] = digest


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree


def code_digest(source: str, filename: str = "<source>") -> str:
    """SHA-256 (hex) of Python ``source`` as a parsed syntax tree: comments, docstrings and layout
    do not count, any change to what the code does does. Raises ``SyntaxError``."""
    tree = _strip_docstrings(ast.parse(textwrap.dedent(source), filename))
    return hashlib.sha256(ast.dump(tree, annotate_fields=True, include_attributes=False).encode()).hexdigest()
