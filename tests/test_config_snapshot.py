"""No task id moves when the settings' declarations change form: every preset, under each of a set of
``--set`` overrides, resolves to the same dict (type for type) and builds the same graph (each task's
family, id, folder and hashed configuration) as recorded in ``tests/config_snapshot.json``
(:mod:`tests.config_snapshot`)."""
from __future__ import annotations

import json

from tests.config_snapshot import SNAPSHOT, cases, record


def test_every_preset_and_override_resolves_and_hashes_as_recorded():
    want = json.loads(SNAPSHOT.read_text())
    assert sorted(want) == sorted(f"{p} | {o}" for p, o in cases()), "the cases changed: re-record the snapshot"
    moved = [key for key in want if record(*key.split(" | ", 1)) != want[key]]
    assert not moved, f"these cases resolve or hash differently from the recorded code: {moved}"
    assert sum("error" not in r for r in want.values()) >= 400  # most cases build a graph


def test_the_snapshot_sees_a_moved_id(monkeypatch):
    from zgcore.config import schema

    monkeypatch.setitem(schema.Train.model_fields["log_every"].json_schema_extra, "hashed", True)  # a broken rule
    want = json.loads(SNAPSHOT.read_text())
    assert record("tiny", "") != want["tiny | "]
