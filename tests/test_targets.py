"""Cached and online targets give bitwise-identical blocks for the same objective and seed."""
from pathlib import Path

import pytest

from tests.conftest import tiny_cfg
from workflows import RunExperiment


@pytest.mark.parametrize("objective", ["clean", "noisy"])
def test_cached_and_online_blocks_are_byte_identical(objective, tmp_path, run_graph):
    for targets in ("cached", "online"):
        ok, ran = run_graph(RunExperiment(preset="", outputs=str(tmp_path),
                                          set=tiny_cfg(**{"train.targets": targets, "train.objective": objective})))
        assert ok
        fams = [f for f, _ in ran]
        assert ("TeacherBoundary" in fams) == (targets == "cached")  # online never builds the cache
    files = {p.parent.name.split("-")[0] + "-" + p.parent.name.split("-")[2]: p.read_bytes()
             for p in Path(tmp_path).glob("TrainBlock/*/block.safetensors")}
    assert sorted(files) == ["block0-cached", "block0-online", "block1-cached", "block1-online"]
    assert files["block0-cached"] == files["block0-online"]
    assert files["block1-cached"] == files["block1-online"]
    assert files["block0-cached"] != files["block1-cached"]
