"""Out-of-domain held-out text (``eval.extra``): corpora scored besides the training
corpus's validation split, never trained on.

An entry of ``eval.extra`` is a source as ``corpus.source`` takes it (``"stdlib-docstrings"``, a
file, a glob, a list of them; see :mod:`zgcore.data.sources`) or a table ``{name, source, text_field,
max_tokens}``. It is tokenised with the teacher's tokenizer into rows of ``corpus.seq_len`` tokens
(documents joined by EOS, as :func:`zgcore.data.corpus.tokenize` does) — every row held out. Only
evaluation tasks read it: no training task's inputs, configuration or hash depend on it.
"""
from __future__ import annotations

from typing import Any
from collections.abc import Mapping

from zgcore.checks import ConfigError

EXTRA_KEYS = {"name": None, "source": None, "text_field": "text", "max_tokens": 0}


def _name_of(source: Any) -> str:
    text = source if isinstance(source, str) else "+".join(map(str, source))
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text.split("/")[-1])[:40] or "extra"


def extra_corpora(eval_cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``eval.extra`` as a list of ``{"name", "source", "text_field", "max_tokens"}`` (names
    default to the source's last path part), in the order given.

    Raises:
        ConfigError: ``eval.extra`` not a list, an entry that is neither a source nor a table with
            ``source``, an unknown key, a repeated name, ``max_tokens`` not a non-negative integer.
    """
    items = eval_cfg.get("extra") or []
    if not isinstance(items, (list, tuple)):
        raise ConfigError(f"eval.extra must be a list of held-out corpora (sources or tables {{name, source}}), got {items!r}")
    out, names = [], set()
    for i, e in enumerate(items):
        if isinstance(e, Mapping):
            unknown = sorted(set(e) - set(EXTRA_KEYS))
            if unknown or "source" not in e:
                raise ConfigError(f"eval.extra[{i}]: a table needs `source` and may have name, text_field, max_tokens"
                                  + (f"; unknown key(s) {unknown}" if unknown else ""))
            d = {**EXTRA_KEYS, **dict(e)}
        elif isinstance(e, (str, list, tuple)) and e:
            d = {**EXTRA_KEYS, "source": e}
        else:
            raise ConfigError(f"eval.extra[{i}] must be a source (e.g. 'stdlib-docstrings', a file or glob) or a table "
                              f"{{name, source, text_field, max_tokens}}, got {e!r}")
        d["source"] = d["source"] if isinstance(d["source"], str) else [str(x) for x in d["source"]]
        d["name"] = str(d["name"] or _name_of(d["source"]))
        mt = d["max_tokens"]
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 0:
            raise ConfigError(f"eval.extra[{i}].max_tokens must be a non-negative integer (0 = all), got {mt!r}")
        if d["name"] in names:
            raise ConfigError(f"eval.extra: two corpora are named {d['name']!r}; give each a distinct `name`")
        names.add(d["name"])
        out.append(d)
    return out


def validate_extra(eval_cfg: Mapping[str, Any], corpus_cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Check ``eval.extra`` against the training corpus and that its sources exist (cheaply: file
    sizes and schemas, no text read); returns :func:`extra_corpora`.

    Raises:
        ConfigError: as :func:`extra_corpora`; a source that is the training corpus's own source
            (it would not be held out), ``stdlib-docstrings`` with ``python-stdlib`` training text
            (the docstrings are part of those files), or a source that fails :func:`zgcore.data.sources.check`.
    """
    from zgcore.data.sources import check

    out = extra_corpora(eval_cfg)
    train = corpus_cfg["source"]
    for e in out:
        if e["source"] == train:
            raise ConfigError(f"eval.extra {e['name']!r}: its source is the training corpus (corpus.source); "
                              "out-of-domain text must not be trained on")
        if e["source"] == "stdlib-docstrings" and train == "python-stdlib":
            raise ConfigError("eval.extra 'stdlib-docstrings' is part of the training corpus python-stdlib (the docstrings "
                              "are in those files); choose another held-out text")
        check({"source": e["source"], "text_field": e["text_field"]})
    return out
