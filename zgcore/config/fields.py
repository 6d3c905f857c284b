"""How a setting is declared: once, as a field of a pydantic model (:mod:`zgcore.config.schema`,
:mod:`zgcore.local.schema`) with its type, default, bounds or allowed values, whether it enters the hash, and a
one-line description. Checking a section (:func:`check_section`), the "did you mean" error for an unknown key
(:func:`check_keys`), the hash's exclusions (:func:`hashed_view`) and the generated reference
(``docs/configuration.md``, :mod:`workflows.reference`) are all read from those fields.

A setting is one line::

    lr: Float = setting(2e-3, "AdamW peak learning rate", gt=0)

``hashed`` says when the key enters a task's hash: ``True`` (always), ``False`` (never: it changes how a
result is computed, not what), ``NOT_DEFAULT`` (only away from its default, so configurations from before the
setting existed keep their hashes), or a function of the section's values (a key that cannot take effect under
the others is left out). Follows torchtitan's and DistillKit's typed configs. Imports no torch.
"""
from __future__ import annotations

import copy
import difflib
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from zgcore.checks import ConfigError

NOT_DEFAULT = "not default"


def _no_bool_or_str(v: Any) -> Any:
    if isinstance(v, (bool, str)):
        raise ValueError("not a number")
    return v


Int = Annotated[int, BeforeValidator(_no_bool_or_str)]  # an int, or an integral float such as 4.0; never a bool
Float = Annotated[float, BeforeValidator(_no_bool_or_str)]  # an int or a finite float; never a bool or a string
Positive = Annotated[float, BeforeValidator(_no_bool_or_str), Field(gt=0)]  # e.g. an lr search's candidates
Bool = StrictBool
Str = StrictStr


class Section(BaseModel):
    """A configuration section: unknown keys, non-finite numbers and values of the wrong kind are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, protected_namespaces=())


def setting(default: Any, doc: str, *, hashed: bool | str | Callable[[Mapping[str, Any]], bool] = True,
            choices: Callable[[], tuple[str, ...]] | None = None, expect: str | None = None, **bounds: Any) -> Any:
    """One setting's declaration: a pydantic ``Field`` holding ``default`` (a list or dict is copied per
    instance), the one-line ``doc``, ``hashed`` (see the module), ``bounds`` (``ge``, ``gt``, ``le``, ``lt``),
    ``choices`` (a function giving the allowed values of a registry, read when checked, so that declaring the
    setting imports no registry) and ``expect`` (what the error says a value must be, where the type alone
    does not say it well)."""
    extra = {"hashed": hashed, "choices": choices, "expect": expect}
    if isinstance(default, (list, dict)):
        return Field(default_factory=lambda: copy.deepcopy(default), description=doc, json_schema_extra=extra,
                     **bounds)
    return Field(default, description=doc, json_schema_extra=extra, **bounds)


def _extra(field) -> dict[str, Any]:
    return field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}


def default_of(field) -> Any:
    """The declared default of a field (a fresh copy for a list or dict)."""
    return field.get_default(call_default_factory=True)


def defaults(model: type[BaseModel]) -> dict[str, Any]:
    """The model's defaults as a plain nested dict (every section), in declaration order."""
    out = {}
    for name, f in model.model_fields.items():
        sub = _submodel(f.annotation)
        out[name] = defaults(sub) if sub is not None and f.default_factory is sub else default_of(f)
    return out


def _submodel(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def section(model: type[BaseModel]) -> Any:
    """A field holding a whole section ``model`` (its defaults are the section's defaults)."""
    return Field(default_factory=model, description=(model.__doc__ or "").strip().splitlines()[0])


# ----------------------------------------------------------------------------- what a value must be

def bounds_of(field) -> tuple[str, str]:
    """A field's declared bounds as text, ``(lower, upper)``: e.g. ``(">= 1", "")``, ``("> 0", "<= 1")``."""
    lo = hi = ""
    for m in field.metadata:
        if isinstance(m, at.Ge):
            lo = f">= {m.ge}"
        elif isinstance(m, at.Gt):
            lo = f"> {m.gt}"
        elif isinstance(m, at.Le):
            hi = f"<= {m.le}"
        elif isinstance(m, at.Lt):
            hi = f"< {m.lt}"
    return lo, hi


def _kind(annotation: Any) -> str:
    """The base kind of an annotation: ``an integer``, ``a number``, ``true or false``, ``one of a, b``..."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _kind(get_args(annotation)[0])
    if origin is Literal:
        return "one of " + ", ".join(map(str, get_args(annotation)))
    if origin in (Union, type(int | None)):
        args = [a for a in get_args(annotation) if a is not type(None)]
        text = " or ".join(_kind(a) for a in args)
        return text + (" or null" if len(args) < len(get_args(annotation)) else "")
    if origin is list:
        (item,) = get_args(annotation) or (Any,)
        return "a list" + ("" if item is Any else f" of {_kind(item).split(' ', 1)[-1]}s")
    if origin is dict:
        return "a table"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(annotation, "a value")


def expects(field, with_bounds: bool = True) -> str:
    """What a value of ``field`` must be, in words (``a positive integer``, ``a number in (0, 1]``,
    ``one of cached, online``); without ``with_bounds`` only its kind (the message for a value of the wrong type)."""
    extra = _extra(field)
    if extra.get("expect"):
        return extra["expect"]
    if extra.get("choices"):
        return "one of " + ", ".join(extra["choices"]())
    args = get_args(field.annotation) if get_origin(field.annotation) in (Union, type(int | None)) else ()
    optional = type(None) in args and len(args) == 2
    kind = _kind(next(a for a in args if a is not type(None)) if optional else field.annotation)
    lo, hi = bounds_of(field)
    null = " or null" if optional else ""
    if not with_bounds or not (lo or hi):
        return kind + null
    if kind == "an integer" and not hi and lo in (">= 1", "> 0", ">= 0"):
        return ("a positive integer" if lo != ">= 0" else "a non-negative integer") + null
    if lo and hi:
        left, right = "[" if "=" in lo else "(", "]" if "=" in hi else ")"
        return f"{kind} in {left}{lo.split()[-1]}, {hi.split()[-1]}{right}{null}"
    return f"{kind} {lo or hi}{null}"


# ----------------------------------------------------------------------------- checking

# names other tools give settings that exist here under another name (what difflib cannot guess)
KEY_ALIASES = {"learning_rate": "lr", "learning_rates": "lrs", "lr_warmup": "warmup_steps", "warmup": "warmup_steps",
               "steps": "max_steps", "num_steps": "max_steps", "wd": "weight_decay", "clip": "grad_clip",
               "max_grad_norm": "grad_clip", "bs": "batch_size", "layers": "n_layers", "num_layers": "n_layers"}


def nearest_key(key: str, allowed) -> str | None:
    """The known key a misspelled ``key`` most likely means: a common alias (:data:`KEY_ALIASES`:
    ``learning_rate`` -> ``lr``) or the closest spelling (:func:`difflib.get_close_matches`); None."""
    allowed = list(allowed)
    if KEY_ALIASES.get(key) in allowed:
        return KEY_ALIASES[key]
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    return close[0] if close else None


def check_keys(section: str, got: Mapping[str, Any], allowed: Mapping[str, Any] | type[BaseModel]) -> None:
    """Raise ``ConfigError`` naming the first unknown key of ``got`` (``section.key``), the known key
    it most likely means (:func:`nearest_key`), and the known keys (``allowed``: a mapping or a model's fields)."""
    if isinstance(allowed, type):
        allowed = allowed.model_fields
    unknown = sorted(set(got) - set(allowed))
    if unknown:
        where = "" if section == "experiment" or " " in section else f"{section}."  # top level: no prefix
        guess = nearest_key(unknown[0], allowed)
        hint = f": did you mean {where}{guess}?" if guess else ""
        more = f" (and {', '.join(where + k for k in unknown[1:])})" if unknown[1:] else ""
        raise ConfigError(f"unknown key {where}{unknown[0]}{hint}{more}; known in {section}: "
                          f"{', '.join(sorted(allowed))}")


def check_section(model: type[BaseModel], values: Mapping[str, Any], name: Callable[[str], str] | str) -> None:
    """Check ``values`` against ``model``'s declarations; ``values`` itself is left as it is (the hash is
    taken from what the user wrote, so ``4`` stays an int and ``1e-3`` a float).

    ``name``: the dotted prefix of the section (``"train"``), or a function from a key to how the user wrote it
    (``lr`` -> ``blocks.1.lr``).

    Raises:
        ConfigError: one line naming the first unknown key (with "did you mean") or bad value.
    """
    name_of = name if callable(name) else (lambda k, p=name: f"{p}.{k}" if p else k)
    check_keys(name_of("").rstrip(".") or "experiment", values, model)
    try:
        model.model_validate(dict(values))
    except ValidationError as e:
        raise _one_line(model, e.errors()[0], name_of) from None
    key = bad_choices(model, values)
    if key is not None:
        raise ConfigError(f"{name_of(key)} must be {expects(model.model_fields[key])}, got {values[key]!r}")


def _one_line(model: type[BaseModel], err: Mapping[str, Any], name_of: Callable[[str], str]) -> ConfigError:
    """One ``ConfigError`` line from pydantic's first error: the deepest declared field on its path, as the user
    wrote its key (list items as ``[i]``, table entries as ``.key``), what it must be, and the value given."""
    field, path, where, pending, item = None, "", model, None, False
    for part in err["loc"]:
        if pending == "list" and isinstance(part, int):
            path, pending, item = f"{path}[{part}]", None, True
            continue
        if pending == "dict" and isinstance(part, str):
            path, pending, item = f"{path}.{part}", None, True
            continue
        fields = where.model_fields if where is not None else {}
        if field is not None and isinstance(part, str) and part.startswith(("list[", "dict[")) and not pending:
            pending = part[:4]  # the member of a union pydantic tried: list[...] or dict[...]
            continue
        if isinstance(part, str) and part in fields:
            path = name_of(part) if field is None else f"{path}.{part}"
            field, where, pending, item = fields[part], _item_model(fields[part].annotation), \
                _container(fields[part].annotation), False
        elif err["type"] == "extra_forbidden" and where is not None:
            check_keys(path, {part: None}, where)
        else:
            break
    if field is None:
        return ConfigError(f"{name_of('').rstrip('.') or 'configuration'}: {err['msg']}")
    wrong_type = err["type"].endswith(("_type", "_parsing")) or err["msg"] == "Value error, not a number"
    what = expects(field, with_bounds=not wrong_type or item)
    if item:  # one entry of a list or table: the entry, then what the whole setting must be
        return ConfigError(f"{path}={err['input']!r}: {path.rsplit('[', 1)[0]} must be {what}")
    return ConfigError(f"{path} must be {what}, got {err['input']!r}")


def _container(annotation: Any) -> str | None:
    """``"list"`` or ``"dict"`` when a field holds a list or a table (optional or not), else None."""
    args = [a for a in get_args(annotation) if a is not type(None)] if get_origin(annotation) in (
        Union, type(int | None)) else [annotation]
    origin = get_origin(args[0]) if len(args) == 1 else None
    return {list: "list", dict: "dict"}.get(origin)


def _item_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field's value (or its list's / table's items) is checked against, if any."""
    if _submodel(annotation):
        return annotation
    args = [a for a in get_args(annotation) if a is not type(None)]
    return next((m for m in map(_item_model, args) if m is not None), None)


def bad_choices(model: type[BaseModel], values: Mapping[str, Any]) -> str | None:
    """The first key of ``values`` whose value is not among its declared registry ``choices``; None."""
    for k, f in model.model_fields.items():
        pick = _extra(f).get("choices")
        if pick and k in values and values[k] not in pick():
            return k
    return None


# ----------------------------------------------------------------------------- the hash

def hashed_view(model: type[BaseModel], values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` less the keys their declarations leave out of the hash (``hashed``: False, ``NOT_DEFAULT`` at
    the default, or a rule false for these values); keys the model does not declare stay."""
    out = {}
    for k, v in values.items():
        f = model.model_fields.get(k)
        rule = _extra(f).get("hashed", True) if f is not None else True
        if rule is False or (rule == NOT_DEFAULT and v == default_of(f)) or (callable(rule) and not rule(values)):
            continue
        out[k] = v
    return out


def never_hashed(model: type[BaseModel]) -> set[str]:
    """The keys of ``model`` declared ``hashed=False`` (they never enter a hash)."""
    return {k for k, f in model.model_fields.items() if _extra(f).get("hashed", True) is False}


def settings(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, field)`` of every setting declared under ``model``: sections followed (``train.lr``), and
    the settings of a list's or a table's entries after the list's own (``library.variants[].mixer``,
    ``library.blocks.<N>.variants``)."""
    out = []
    for name, f in model.model_fields.items():
        sub = _submodel(f.annotation)
        if sub is not None and f.default_factory is sub:
            out += settings(sub, f"{prefix}{name}.")
            continue
        out.append((prefix + name, f))
        item = _item_model(f.annotation)
        if item is not None:
            out += settings(item, f"{prefix}{name}{'[].' if _container(f.annotation) == 'list' else '.<N>.'}")
    return out


def hashed_text(field) -> str:
    """How the reference describes a setting's ``hashed`` rule: ``yes``, ``no``, ``not at default`` or ``when it
    takes effect`` (the rule's docstring's first line when it has one)."""
    rule = _extra(field).get("hashed", True)
    if callable(rule):
        return (rule.__doc__ or "when it takes effect").strip().splitlines()[0]
    return {True: "yes", False: "no", NOT_DEFAULT: "not at its default"}[rule]


def choices_text(field) -> str:
    """The allowed values of a setting in words, for the reference (``one of a, b``, ``a number in (0, 1]``)."""
    return expects(field)
