"""`zerograph verify`: every byte of every shard of the boundary store against the SHA-256 recorded
when it was written; a damaged shard is named, moved aside and the command exits 1; a whole store
exits 0."""
import json

import luigi
import pytest
from typer.testing import CliRunner

from tests.conftest import tiny_cfg
from workflows.cli import app, walk
from workflows.experiment import build_experiment, load_config

CFG = tiny_cfg(**{"boundary.shard_sequences": 16})


def _verify(out, cfg=CFG):
    return CliRunner().invoke(app, ["verify", "--preset", "", "--set", cfg, "--outputs", str(out)])


@pytest.fixture
def cache(tmp_path):
    out = tmp_path / "o"
    root = build_experiment(load_config(overrides=CFG, preset=""), str(out))
    (join,) = [t for t in walk(root) if t.get_task_family() == "TeacherBoundary"]
    assert luigi.build([join], local_scheduler=True, log_level="WARNING")
    return out, join


def test_verify_exits_0_on_a_whole_store_and_1_naming_a_shard_with_one_flipped_data_byte(cache):
    out, join = cache
    r = _verify(out)
    m = json.loads((join.out_dir / "manifest.json").read_text())
    assert r.exit_code == 0, r.output
    # every shard (its file per boundary) and the join's statistics, every byte of them; and every
    # finished task output with content hashes (the teacher, the corpus, the join's own files)
    from workflows.verify_outputs import task_outputs

    n_outputs = len(task_outputs(walk(build_experiment(load_config(overrides=CFG, preset=""), str(out)))))
    assert n_outputs == 3
    assert f"verified {m['n_shards'] + 1 + n_outputs} item(s)" in r.stdout and "all whole" in r.stdout
    assert m["n_shards"] >= 3

    sh = m["shards"][1]
    folder = (join.out_dir / sh["dir"]).resolve()
    name, e = sorted(sh["files"].items())[-1]
    f = folder / e["name"]
    raw = bytearray(f.read_bytes())
    lo, n = e["data"]
    raw[lo + n // 2] ^= 0x10  # one bit of the sequence data: the open-time check cannot see it, verify must
    f.write_bytes(bytes(raw))
    r = _verify(out)
    assert r.exit_code == 1
    assert f"damaged: {f}: checksum failure" in r.stderr and "1 damaged of" in r.stderr
    assert not folder.exists() and list(folder.parent.glob(f"{folder.name}.damaged-*"))  # moved aside, as a read does
    others = [(join.out_dir / s["dir"]).resolve() for i, s in enumerate(m["shards"]) if i != 1]
    assert all(o.is_dir() for o in others)  # only the damaged shard moved


def test_verify_names_a_damaged_statistics_file_and_a_configuration_error_exits_2(cache):
    out, join = cache
    st = join.out_dir / "stats-b0.npy"
    raw = bytearray(st.read_bytes())
    raw[-1] ^= 0x01
    st.write_bytes(bytes(raw))
    r = _verify(out)
    assert r.exit_code == 1 and f"damaged: {st}: checksum failure" in r.stderr
    assert not st.exists() and list(join.out_dir.glob("stats-b0.npy.damaged-*"))
    assert _verify(out, CFG + " train.lr=-1").exit_code == 2


def test_the_checkers_are_a_list_another_kind_of_artefact_joins(cache, monkeypatch):
    from workflows import verify as v

    out, _ = cache
    seen = []

    def extra(tasks):
        seen.append(len(tasks))
        return [v.Item("an artefact", 0, lambda progress: [(out / "x", "made up")])]

    monkeypatch.setattr(v, "CHECKERS", [*v.CHECKERS, extra])
    r = _verify(out)
    assert seen and r.exit_code == 1 and f"damaged: {out / 'x'}: made up" in r.stderr
