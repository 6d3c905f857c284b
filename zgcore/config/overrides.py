"""Command-line overrides (``--set``): splitting them into ``key=value`` items, parsing each
value as YAML, and the YAML loader experiment files share (``1e-4`` is a float)."""
from __future__ import annotations

import re
from typing import Any

import yaml

from zgcore.checks import ConfigError


class _Loader(yaml.SafeLoader):
    """YAML 1.1 SafeLoader that also reads ``1e-4`` (no dot) as a float, as YAML 1.2 and TOML do."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def yaml_load(text: str):
    """Parse YAML ``text`` with :class:`_Loader`. Raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=_Loader)


def split_overrides(text: str | None) -> list[str]:
    """The ``key=value`` items of an overrides string: one ``--set`` argument per line (a repeated
    ``--set`` arrives as its values joined by newlines), items within a line separated by
    whitespace outside brackets, braces and quotes (``boundary.boundaries=[0, 2, 4]`` is one item).
    An unclosed bracket or quote ends its item at the end of its line."""
    items: list[str] = []
    for line in (text or "").splitlines():
        cur, depth, quote = "", 0, ""
        for ch in line:
            if quote:
                quote = "" if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch in "[{":
                depth += 1
            elif ch in "]}":
                depth = max(0, depth - 1)
            elif ch.isspace() and depth == 0:
                if cur:
                    items.append(cur)
                cur = ""
                continue
            cur += ch
        if cur:
            items.append(cur)
    return items


def parse_overrides(text: str | None) -> dict[str, Any]:
    """Parse ``"train.lr=1e-4 blocks.1.lr=5e-5 boundary.boundaries=[0, 2, 4]"`` into a nested dict.

    Items are split by :func:`split_overrides` (one ``--set`` per line; spaces inside ``[...]``,
    ``{...}`` and quotes stay in the value); values are YAML scalars or flow lists. Items apply in
    order: a key given twice (also across repeated ``--set`` options) takes its later value.

    Raises:
        ConfigError: an item without ``=``, an empty key, or a value that is not valid YAML (the
            message names the key and shows the value).
    """
    out: dict[str, Any] = {}
    for item in split_overrides(text):
        key, eq, raw = item.partition("=")
        if not eq or not key or "" in key.split("."):
            raise ConfigError(f"--set {item!r} must look like key.sub=value (quote a value with spaces: "
                              "--set \"name='my run'\")")
        try:
            value = yaml_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            why = str(getattr(e, "problem", None) or e).splitlines()[0]
            raise ConfigError(f"--set {key}={raw}: the value is not valid YAML ({why}); write numbers as 1e-4, "
                              "lists as [0, 2, 4] (quoted as one --set argument), strings with spaces in quotes") from None
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {part} was given a value earlier, it cannot also hold keys")
        node[parts[-1]] = value
    return out
