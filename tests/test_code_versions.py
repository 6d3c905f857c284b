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
    v = record["TrainBlock"]["version"]
    assert f"TrainBlock.code_version is still {v}: raise it to {v + 1} in tasks/blocks.py" in msg
    assert versions.COMMAND in msg
    record["TrainBlock"]["version"] = v - 1  # bumped (v now) but not recorded: asks for the command only
    fake.write_text(json.dumps(record))
    (msg,) = versions.problems()
    assert "is not recorded yet" in msg


def test_code_version_and_precision_move_the_hash_but_the_device_index_does_not(tmp_path, monkeypatch):
    from tests.conftest import tiny_cfg
    from workflows.cli import walk
    from workflows.experiment import build_experiment, load_config

    def block0(extra="", version=None):
        if version is not None:
            from tasks.blocks import TrainBlock
            monkeypatch.setattr(TrainBlock, "code_version", version)
            luigi.task_register.Register.clear_instance_cache()  # Luigi reuses task instances (and their uid)
        tasks = walk(build_experiment(load_config(overrides=tiny_cfg() + extra, preset=""), str(tmp_path)))
        return next(t for t in tasks if t.get_task_family() == "TrainBlock")

    cpu, cuda, cuda1 = block0(), block0(" device=cuda"), block0(" device=cuda:1")
    assert cpu.out_dir != cuda.out_dir and cuda.out_dir == cuda1.out_dir
    assert cpu.numerics() == {"code_version": cpu.code_version, "precision": "float32"}
    assert cuda.numerics()["precision"] == "bf16-autocast"
    assert block0(version=cpu.code_version + 1).out_dir != cpu.out_dir


def test_every_task_family_is_guarded_whatever_was_imported_before():
    """Families of modules that are imported lazily (LayerImportance, the distillation tasks) are
    registered by the guard itself, so the check does not depend on which tests ran first."""
    import subprocess
    import sys
    from pathlib import Path

    code = "from tasks import versions; print(' '.join(versions.families()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(versions.__file__).parents[1], capture_output=True,
                         text=True, check=True).stdout.split()
    assert {"LayerImportance", "Heal", "DistillE2E", "BoundaryShard", "PretrainLocal", "SeedSummary"} <= set(out)
    assert set(out) == set(json.loads(versions.RECORD.read_text()))


def test_the_cache_join_is_named_by_its_shards_numerics_not_by_the_shard_plan(tmp_path, monkeypatch):
    """A bf16-autocast cache (CUDA shards) or one built by other shard code is another cache: the
    join's name moves with the shards' precision and code version, not with the shard plan."""
    from tests.conftest import tiny_cfg
    from tasks.cache import BoundaryShard
    from workflows.cli import walk
    from workflows.experiment import build_experiment, load_config

    def join(extra=""):
        luigi.task_register.Register.clear_instance_cache()
        tasks = walk(build_experiment(load_config(overrides=tiny_cfg() + extra, preset=""), str(tmp_path)))
        return next(t for t in tasks if t.get_task_family() == "TeacherBoundary")

    cpu = join()
    assert join(" device=cuda").out_dir != cpu.out_dir and join(" device=cuda:1").out_dir == join(" device=cuda").out_dir
    assert join(" boundary.shard_sequences=16").out_dir == cpu.out_dir
    monkeypatch.setattr(BoundaryShard, "code_version", BoundaryShard.code_version + 1)
    assert join().out_dir != cpu.out_dir
