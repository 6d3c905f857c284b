"""A task's hashed code cannot change without its code_version (tasks/versions.py)."""
import json

import luigi

from tasks import versions


def test_every_family_matches_its_recorded_code_version():
    found = versions.problems()
    assert not found, "\n".join(found)


def test_a_change_without_a_bump_is_caught_and_says_what_to_do():
    record = versions.current()
    record["TrainBlock"]["digest"] = "0" * 64  # as if TrainBlock's code had changed since it was recorded
    record["TrainBlock"]["code"]["zgcore.training.loop"] = "0" * 16
    (msg,) = versions.problems(record)
    v = record["TrainBlock"]["version"]
    assert f"TrainBlock.code_version is still {v}: raise it to {v + 1} in tasks/blocks.py" in msg
    assert "TrainBlock's code changed (zgcore/training/loop.py)" in msg and versions.COMMAND in msg
    record["TrainBlock"]["version"] = v - 1  # bumped (v now) but not recorded: asks for the command only
    (msg,) = versions.problems(record)
    assert "is not recorded yet" in msg


def test_a_family_s_code_is_derived_from_its_imports_lazy_ones_included():
    """No hand-written list: the closure of a family's module over zgcore/ and tasks/ imports."""
    from tasks.base import ZGTask

    assert not hasattr(ZGTask, "code_deps")
    code = versions.current()
    train = set(code["TrainBlock"]["code"])
    # its own module, what it imports at the top (zgcore.training.blocks), lazily in run() (zgcore.models.teacher_weights),
    # and further down (zgcore.training.loop via zgcore.training.blocks; zgcore.models.families via zgcore.models.adapters)
    assert {"tasks.blocks", "zgcore.training.blocks", "zgcore.models.teacher_weights", "zgcore.training.loop", "zgcore.models.families", "zgcore",
            "tasks"} <= train
    assert "tasks.local" not in train and "zgcore.local.training" not in train  # another stage's code is not its code
    assert "zgcore.data.sources" in code["PrepareCorpus"]["code"]  # how corpus files are read
    assert versions.closure("tasks.blocks") == sorted(train)


def test_an_edit_to_families_sources_or_objectives_fails_the_guard_in_a_copy_of_the_repository(tmp_path):
    """Acceptance 2: in a temporary copy, record the guard, then append one line of code to each of
    three modules in turn: the guard fails naming the module and the families that run it (and
    `python -m tasks.versions` exits 1); a comment alone changes nothing."""
    import shutil
    import subprocess
    import sys

    repo = tmp_path / "repo"
    for pkg in ("zgcore", "tasks"):
        shutil.copytree(versions.ROOT / pkg, repo / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    expect = {"zgcore/models/families.py": {"PrepareTeacher", "BoundaryShard", "TrainBlock", "Heal", "DistillE2E", "Evaluate"},
              "zgcore/data/sources.py": {"PrepareCorpus", "TrainBlock", "PretrainLocal"},
              "zgcore/training/objectives.py": {"TrainBlock", "DistillE2E", "Heal"}}
    script = f"""
import json, pathlib
from tasks import versions
assert versions.ROOT == pathlib.Path.cwd(), versions.ROOT  # the copy's guard, reading the copy's files
versions.write()
out = {{"clean": versions.problems()}}
for rel in {sorted(expect, key=lambda r: r == 'zgcore/data/sources.py')!r}:  # sources.py last: it keeps its probe
    f = pathlib.Path(rel)
    text = f.read_text()
    f.write_text(text + "\\n# a comment changes no output\\n")
    out[rel + " comment"] = versions.problems()
    f.write_text(text + "\\n_GUARD_PROBE = 1\\n")
    out[rel] = versions.problems()
    if rel != "zgcore/data/sources.py":
        f.write_text(text)
print(json.dumps(out))
"""
    env = {"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", script], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["clean"] == [] and all(out[f"{rel} comment"] == [] for rel in expect)
    for rel, families in expect.items():
        lines = [line for line in out[rel] if "'s code changed" in line]
        assert families <= {line.split("'s code changed")[0] for line in lines}, (rel, out[rel])
        assert all(rel in line for line in lines), out[rel]  # each message names the module that changed
    # the command itself fails while zgcore/data/sources.py still carries its extra line
    r = subprocess.run([sys.executable, "-m", "tasks.versions"], cwd=repo, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and "PrepareCorpus's code changed (zgcore/data/sources.py)" in r.stdout


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
