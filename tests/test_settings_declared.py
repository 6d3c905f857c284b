"""Every setting is declared once (zgcore.config.schema, zgcore.local.schema) and everything else follows from
the declaration: each declared setting, enumerated from the models (never a hand list), has its row in
docs/configuration.md with its type, default and allowed values, and a value outside what it declares (or a
key it does not declare) is a one-line ConfigError naming the key as the user wrote it; through the CLI, one
sample of each kind exits 2."""
from __future__ import annotations

import json
import re
from typing import Any, Literal, Union, get_args, get_origin

import pytest
from typer.testing import CliRunner

from workflows import reference
from workflows.cli import app
from workflows.experiment import load_preset
from zgcore.checks import ConfigError
from zgcore.config import fields
from zgcore.config.experiment import resolve
from zgcore.config.schema import Experiment
from zgcore.local.resolve import resolve_local
from zgcore.local.schema import LocalStudy

BASE = "teacher=tiny-llama corpus.seq_len=32"
SCHEMAS = {"experiment": Experiment, "local": LocalStudy}


def _all_settings():
    return [(schema, key, f) for schema, model in SCHEMAS.items() for key, f in fields.settings(model)]


def _strip(annotation: Any) -> tuple[Any, bool]:
    """The annotation without ``None`` and ``Annotated`` wrappers; whether it was optional."""
    if get_origin(annotation) in (Union, type(int | None)):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return (args[0] if len(args) == 1 else annotation), len(args) < len(get_args(annotation))
    return annotation, False


def bad_value(f) -> tuple[Any, str] | None:
    """A value ``f``'s declaration rejects, and its kind (``choice``, ``bool``, ``bound``, ``type``)."""
    extra = f.json_schema_extra or {}
    ann, _ = _strip(f.annotation)
    while hasattr(ann, "__metadata__"):
        ann = get_args(ann)[0]
    lo, hi = fields.bounds_of(f)
    if extra.get("choices") or get_origin(ann) is Literal or (get_origin(ann) is Union and any(
            get_origin(a) is Literal for a in get_args(ann))):
        return "no-such-choice", "choice"
    if ann is bool:
        return 3, "bool"
    if ann in (int, float) and lo:
        edge = float(lo.split()[-1])
        value = edge - 1 if "=" in lo else edge
        return (int(value) if ann is int else value), "bound"
    if ann in (int, float) and hi:
        return float(hi.split()[-1]) + 1, "bound"
    if ann in (int, float):
        return "abc", "type"
    if ann is str:
        return 3, "type"
    if get_origin(ann) in (list, dict, Union):
        return 3, "type"
    return None


def _override(key: str, value: Any) -> tuple[str, str]:
    """The ``--set`` text that gives ``key`` the value, and the key as the error must name it (``[].`` and
    ``<N>`` become the first entry: ``library.variants[0].mixer``, ``library.blocks.0.variants``)."""
    v = json.dumps(value)
    named = key.replace("[].", "[0].").replace("<N>", "0")
    if "[]." in key:
        outer, inner = key.split("[].", 1)
        entry = {"K": 2} if outer == "study.configs" and inner != "K" else {}
        nested = f"{{{', '.join([*(f'{k}: {x}' for k, x in entry.items()), f'{inner}: {v}'])}}}"
        if ".<N>." in outer:  # library.blocks.<N>.variants[].x
            top, sub = outer.split(".<N>.", 1)
            return f"{top}={{0: {{{sub}: [{nested}]}}}}", named
        return f"{outer}=[{nested}]", named
    if ".<N>." in key:
        top, sub = key.split(".<N>.", 1)
        return f"{top}={{0: {{{sub}: {v}}}}}", named
    return f"{key}={v}", named


def _resolve(schema: str, over: str):
    if schema == "local":
        return resolve_local(None, over, base=load_preset("local_tiny", "local"))
    return resolve(None, f"{BASE} {over}")


def test_settings_are_enumerated_from_the_declarations():
    keys = {(s, k) for s, k, _ in _all_settings()}
    assert len(keys) > 120
    assert {("experiment", "train.prefetch_mode"), ("experiment", "library.variants[].mixer"),
            ("local", "model.vocab"), ("local", "study.configs[].execution")} <= keys
    assert all(f.description for _, _, f in _all_settings()), "every setting says what it means"


@pytest.mark.parametrize("schema, key, f", _all_settings(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_setting_is_documented_and_checked(schema, key, f):
    title = reference.sections()[list(SCHEMAS).index(schema)][0]
    page = reference.DOC.read_text().split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    row = re.search(rf"^\| `{re.escape(key)}` \| (.*?) \| `(.*?)` \| (.*?) \| (.*?) \| (.*?) \|$", page, re.MULTILINE)
    assert row, f"{key} has no row in docs/configuration.md"
    typ, default, allowed = (x.replace("\\|", "|") for x in row.groups()[:3])
    assert typ == reference.type_text(f.annotation) and typ
    assert json.loads(default) == fields.default_of(f)
    assert allowed == fields.expects(f) and allowed
    bad = bad_value(f)
    if bad is None:
        pytest.skip(f"{key} takes any value")
    over, named = _override(key, bad[0])
    with pytest.raises(ConfigError) as e:
        _resolve(schema, over)
    msg = str(e.value)
    assert "\n" not in msg and named in msg, (over, msg)


@pytest.mark.parametrize("schema, model", list(SCHEMAS.items()))
def test_an_unknown_key_in_every_section_names_it_and_its_nearest_spelling(schema, model):
    sections = [k for k, f in model.model_fields.items() if f.default_factory is f.annotation]
    assert len(sections) >= 6
    for sec in ["", *sections]:
        sub = model.model_fields[sec].annotation if sec else model
        first = next(iter(sub.model_fields))
        dotted = f"{sec}." if sec else ""
        with pytest.raises(ConfigError) as e:
            _resolve(schema, f"{dotted}{first}x=1")
        assert str(e.value).startswith(f"unknown key {dotted}{first}x: did you mean {dotted}{first}?"), str(e.value)
        assert "\n" not in str(e.value)


def test_each_kind_of_bad_value_exits_2_through_the_cli(tmp_path):
    kinds = {}
    for schema, key, f in _all_settings():
        bad = bad_value(f)
        if schema == "experiment" and bad and "[]" not in key and "<N>" not in key:
            kinds.setdefault(bad[1], (key, bad[0]))
    assert set(kinds) == {"choice", "bool", "bound", "type"}
    samples = [_override(k, v) for k, v in kinds.values()] + [("train.lrr=1", "unknown key train.lrr")]
    for over, named in samples:
        r = CliRunner().invoke(app, ["status", "--preset", "tiny", "--set", over, "--outputs", str(tmp_path)])
        errors = [x for x in r.output.splitlines() if x.startswith("error: ")]
        assert r.exit_code == 2 and len(errors) == 1 and named in errors[0], (over, r.output)
        assert "Traceback" not in r.output


def test_a_hash_rule_is_read_from_the_declaration():
    t = fields.defaults(Experiment)["train"]
    kept = fields.hashed_view(Experiment.model_fields["train"].annotation, t)
    assert "log_every" not in kept and "mixer" not in kept and "lr" in kept  # False / NOT_DEFAULT / a rule
    assert "mixer" in fields.hashed_view(Experiment.model_fields["train"].annotation, {**t, "mixer": "linear"})
    from zgcore.training.objectives import objective_settings

    for k in objective_settings():  # a setting an objective reads enters the hash only where it is read
        rule = Experiment.model_fields["train"].annotation.model_fields[k].json_schema_extra["hashed"]
        assert callable(rule) and rule.__doc__ == f"when the objective reads {k}"


def test_a_choice_declared_beside_its_registry_names_the_same_values():
    from zgcore.config.schema import Library
    from zgcore.models.costs import UNITS

    assert get_args(Library.model_fields["budget_unit"].annotation) == UNITS
