"""No task id moves when the settings' declarations change form: every preset, and each of a set of ``--set``
overrides on one tiny preset per graph shape, resolves to the same dict (type for type) and builds the same
graph (each task's family, id, folder and hashed configuration) as recorded in ``tests/config_snapshot.json``
(:mod:`tests.config_snapshot`; ``python -m tests.config_snapshot --check`` runs all 488 cases)."""
from __future__ import annotations

import json

from tests.config_snapshot import SNAPSHOT, SUITE, cases, moved, record


def test_every_preset_and_override_resolves_and_hashes_as_recorded():
    want = json.loads(SNAPSHOT.read_text())
    assert sorted(want) == sorted(f"{p} | {o}" for p, o in cases()), "the cases changed: re-record the snapshot"
    keys = [f"{p} | {o}" for p, o in cases() if not o or p in SUITE]
    assert len(keys) > 90 and sum("error" not in want[k] for k in keys) > 80  # most cases build a graph
    bad = moved(keys)
    assert not bad, f"these cases resolve or hash differently from the recorded code: {bad}"


def test_the_snapshot_sees_a_moved_id(monkeypatch):
    from zgcore.config import schema

    monkeypatch.setitem(schema.Train.model_fields["log_every"].json_schema_extra, "hashed", True)  # a broken rule
    want = json.loads(SNAPSHOT.read_text())
    assert record("tiny", "") != want["tiny | "]
