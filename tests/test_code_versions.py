"""A task's hashed code cannot change without its code_version (tasks/versions.py)."""
import json

import luigi

from tasks import versions


def test_every_family_matches_its_recorded_code_version():
    found = versions.problems()
    assert not found, "\n".join(found)


def test_a_change_without_a_bump_is_caught_and_says_what_to_do(tmp_path, monkeypatch):
    record = json.loads(versions.RECORD.read_text())
    record["TrainBlock"]["digest"] = "0" * 64  # as if TrainBlock's code had changed since it was recorded
    fake = tmp_path / "code_versions.json"
    fake.write_text(json.dumps(record))
    monkeypatch.setattr(versions, "RECORD", fake)
    (msg,) = versions.problems()
    assert "TrainBlock.code_version is still 1: raise it to 2 in tasks/pipeline.py" in msg
    assert versions.COMMAND in msg
    record["TrainBlock"]["version"] = 0  # bumped (1 now) but not recorded: asks for the command only
    fake.write_text(json.dumps(record))
    (msg,) = versions.problems()
    assert "is not recorded yet" in msg


def test_code_version_and_precision_move_the_hash_but_the_device_index_does_not(tmp_path, monkeypatch):
    from tests.conftest import tiny_cfg
    from workflows.cli import walk
    from workflows.experiment import build_experiment, load_config

    def block0(extra="", version=None):
        if version is not None:
            from tasks.pipeline import TrainBlock
            monkeypatch.setattr(TrainBlock, "code_version", version)
            luigi.task_register.Register.clear_instance_cache()  # Luigi reuses task instances (and their uid)
        tasks = walk(build_experiment(load_config(overrides=tiny_cfg() + extra, preset=""), str(tmp_path)))
        return next(t for t in tasks if t.get_task_family() == "TrainBlock")

    cpu, cuda, cuda1 = block0(), block0(" device=cuda"), block0(" device=cuda:1")
    assert cpu.out_dir != cuda.out_dir and cuda.out_dir == cuda1.out_dir
    assert cpu.numerics() == {"code_version": 1, "precision": "float32"}
    assert cuda.numerics()["precision"] == "bf16-autocast"
    assert block0(version=2).out_dir != cpu.out_dir
