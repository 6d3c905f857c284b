"""Complete means whole and current: a task folder with a file missing or cut short is moved aside
and rebuilt, with everything downstream of it; results computed at another precision never share
a name or a checkpoint."""
import shutil
import pytest
import torch

from tests.conftest import tiny_cfg
from workflows import RunExperiment
from workflows.cli import walk
from workflows.experiment import build_experiment, load_config
from zgcore.training import blocks as ztrain

CFG = tiny_cfg(**{"train.max_steps": 3, "eval.context_sequences": 1, "eval.max_sequences": 4})


def graph(out, extra=""):
    return walk(build_experiment(load_config(overrides=CFG + extra, preset=""), str(out)))


def closure_downstream(tasks, target):
    """``target`` and every task that reads it, directly or through others."""
    hit = {target.task_id}
    for t in tasks:  # walk() lists dependencies first
        if any(u.task_id in hit for u in t.upstream()):
            hit.add(t.task_id)
    return {(t.get_task_family(), t.label()) for t in tasks if t.task_id in hit}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One finished tiny experiment, copied by each test that damages it."""
    import luigi

    out = tmp_path_factory.mktemp("finished")
    assert luigi.build([RunExperiment(preset="", set=CFG, outputs=str(out))], local_scheduler=True, log_level="WARNING")
    return out


@pytest.mark.parametrize("family, damage", [
    ("Evaluate", "remove"), ("Assemble", "truncate"), ("TrainBlock", "remove"), ("TeacherBoundary", "remove"),
    ("PrepareCorpus", "truncate"), ("PrepareTeacher", "remove")])
def test_a_missing_or_short_file_rebuilds_the_task_and_what_depends_on_it(family, damage, finished, tmp_path, run_graph):
    tmp_path = tmp_path / "out"
    shutil.copytree(finished, tmp_path)
    tasks = graph(tmp_path)
    target = next(t for t in tasks if t.get_task_family() == family)  # for TrainBlock: block 0
    files = target.record()["files"]
    name = max(files, key=lambda f: (files[f], f))  # its largest file
    path = target.out_dir / name
    if damage == "remove":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:-1])
    want = closure_downstream(tasks, target)
    assert {(t.get_task_family(), t.label()) for t in tasks if not t.complete()} == want
    ok, ran = run_graph(RunExperiment(preset="", set=CFG, outputs=str(tmp_path)))
    assert ok and {r for r in ran if r[0] != "RunExperiment"} == want
    assert (target.out_dir / name).is_file() and target.complete()  # rebuilt whole
    assert list(target.out_dir.parent.glob(f"{target.out_dir.name}.damaged-*"))  # the damaged one kept aside
    assert all(t.complete() for t in graph(tmp_path))


def test_precision_changes_trainblock_path_and_a_checkpoint_of_another_precision_is_never_resumed(finished, tmp_path,
                                                                                                 run_graph, capfd):
    cpu = next(t for t in graph(tmp_path) if t.get_task_family() == "TrainBlock")
    cuda = next(t for t in graph(tmp_path, " device=cuda") if t.get_task_family() == "TrainBlock")
    assert cpu.out_dir != cuda.out_dir and cpu.work_dir != cuda.work_dir and cpu.uid != cuda.uid
    ref = finished
    ref_block = next(t for t in graph(ref) if t.get_task_family() == "TrainBlock")
    # a checkpoint taken under bf16 autocast, found where the float32 run keeps its checkpoints
    state = torch.load(ref_block.out_dir / ztrain.FINAL_STATE, weights_only=False)
    state["run_hash"], state["step"] = cuda.uid, 1
    state["digest"] = ztrain.state_digest({k: v for k, v in state.items() if k != "digest"})  # a sound file
    cpu.work_dir.mkdir(parents=True)
    torch.save(state, cpu.work_dir / ztrain.CKPT)
    capfd.readouterr()
    assert run_graph(RunExperiment(preset="", set=CFG, outputs=str(tmp_path)))[0]
    log = capfd.readouterr().out
    assert "written by another configuration" in log and "resumed from step" not in log
    assert (cpu.out_dir / "block.safetensors").read_bytes() == (ref_block.out_dir / "block.safetensors").read_bytes()


def test_outputs_carry_the_umask_permissions(finished):
    """safetensors writes through a 0600 tempfile; every output is group- and world-readable under umask 022."""
    import os

    old = os.umask(0o022)
    try:
        from zgcore.training.blocks import save_weights

        save_weights(finished / "w.safetensors", {"a": torch.zeros(2)})
        assert (finished / "w.safetensors").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)
    weights = list(finished.glob("TrainBlock/*/block.safetensors")) + list(finished.glob("Assemble/*/model/*.safetensors"))
    assert len(weights) == 3
    mask = os.umask(0)
    os.umask(mask)
    assert all(f.stat().st_mode & 0o777 == 0o666 & ~mask for f in weights)  # the umask of the run that wrote them


def test_local_learning_families_rebuild_a_damaged_output_and_what_reads_it(tmp_path, run_graph):
    from workflows import LocalLearningStudy

    study = dict(preset="local_tiny", set="study.K=[1] study.aux=[mlp] study.mtp=[off]", outputs=str(tmp_path))
    assert run_graph(LocalLearningStudy(**study))[0]
    for family, expect in (("LocalStudyReport", ["LocalStudyReport"]),
                           ("EvaluateLocal", ["EvaluateLocal", "LocalStudyReport"]),
                           ("PretrainLocal", ["EvaluateLocal", "LocalStudyReport", "PretrainLocal"])):
        (folder,) = [p for p in tmp_path.glob(f"{family}/*") if "." not in p.name]
        next(f for f in sorted(folder.rglob("*")) if f.is_file() and f.name != "task.json").unlink()
        ok, ran = run_graph(LocalLearningStudy(**study))
        assert ok and sorted(f for f, _ in ran if f != "LocalLearningStudy") == expect, family


def test_a_task_requires_every_output_it_reads(tmp_path):
    """Evaluate reads the cache's manifest (economics) and the blocks' files; the local study's
    report reads each model's metrics.json besides its evaluation: each is a declared input, so a
    rebuilt one makes the reader stale."""
    from workflows.local import build_local_study, load_local_config

    ev = next(t for t in graph(tmp_path) if t.get_task_family() == "Evaluate")
    assert {"TeacherBoundary", "TrainBlock", "Assemble", "PrepareCorpus"} <= {u.get_task_family() for u in ev.upstream()}
    cfg = load_local_config(overrides="study.K=[1,2] study.aux=[mlp] study.mtp=[off]", preset="local_tiny")
    report = build_local_study(cfg, str(tmp_path))
    assert sorted(u.get_task_family() for u in report.upstream()) == ["EvaluateLocal"] * 2 + ["PretrainLocal"] * 2


def damage(tasks, families):
    """Remove the largest recorded file of the first task of each family; return what must rebuild."""
    want = set()
    for family in families:
        target = next(t for t in tasks if t.get_task_family() == family)
        files = target.record()["files"]
        (target.out_dir / max(files, key=lambda f: (files[f], f))).unlink()
        want |= closure_downstream(tasks, target)
    return want


def roots(case, out):
    """The tasks run by each case: healing and the distillation study's end-to-end arm on the
    distill_tiny preset; two seeds of students kept by measured importance."""
    from workflows import build_experiment, load_config
    from workflows.distill import build_distill_study

    if case == "distill":
        study = build_distill_study(load_config("", "", "distill_tiny"), str(out)).requires()
        return [study["healed"], study["e2e"]]
    over = tiny_cfg(**{"train.max_steps": 2, "seeds": "[0,1]", "eval.max_sequences": 4, "train.keep": "importance",
                       "train.importance_sequences": 4})
    return [build_experiment(load_config("", over, ""), str(out))]


@pytest.mark.parametrize("case, families", [
    ("distill", ["BoundaryShard", "Heal", "DistillE2E", "EvaluateStudent"]),
    ("seeds", ["LayerImportance", "SeedSummary"])])
def test_every_other_family_rebuilds_a_damaged_output_and_what_reads_it(case, families, tmp_path, run_graph):
    """The families the tests above do not damage: the cache's shards, the layer measurements,
    healing, the end-to-end distillation arm and the seed summary (one file removed from each at once)."""
    assert run_graph(*roots(case, tmp_path))[0]
    tasks = list({t.task_id: t for r in roots(case, tmp_path) for t in walk(r)}.values())
    assert set(families) <= {t.get_task_family() for t in tasks}
    want = damage(tasks, families)
    assert {(t.get_task_family(), t.label()) for t in tasks if not t.complete()} == want
    ok, ran = run_graph(*roots(case, tmp_path))
    assert ok and set(ran) == want
    assert all(t.complete() for r in roots(case, tmp_path) for t in walk(r))


def test_a_flipped_byte_in_a_blocks_weights_is_damaged_and_only_that_block_is_retrained(finished, tmp_path, run_graph):
    """Four bytes overwritten inside block 0's tensor data (same size, modification time put back):
    `zerograph status` (a new process) says `damaged` for that block, its consumers `stale`; a
    consumer loading it fails in one line and moves it aside; the next run retrains block 0 only,
    to the same bytes, and rebuilds what read it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tasks.base import DamagedOutputError
    from tasks.blocks import load_blocks

    out = tmp_path / "out"
    shutil.copytree(finished, out)
    tasks = graph(out)
    block0 = next(t for t in tasks if t.get_task_family() == "TrainBlock")
    f = block0.out_dir / "block.safetensors"
    good, st = f.read_bytes(), f.stat()
    bad = bytearray(good)
    bad[-64:-60] = bytes(b ^ 0x5A for b in bad[-64:-60])  # inside the last tensor's data
    f.write_bytes(bad)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == len(good)

    status = subprocess.run([str(Path(sys.executable).parent / "zerograph"), "status", "--preset", "", "--set", CFG,
                             "--outputs", str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert status.returncode == 1, status.stderr
    states = {line.split()[0] + " " + line.split()[1]: line.split()[2] for line in status.stdout.splitlines()}
    assert states[f"TrainBlock {block0.label()}"] == "damaged", status.stdout
    assert [k for k, v in states.items() if v == "damaged"] == [f"TrainBlock {block0.label()}"], status.stdout
    assert states["Assemble student"] == "stale" and list(states.values()).count("done") >= 5, status.stdout

    copy = tmp_path / "consumer"  # a consumer that loads the block checks it first: one line, moved aside
    shutil.copytree(out, copy)
    blk = next(t for t in graph(copy) if t.get_task_family() == "TrainBlock")
    with pytest.raises(DamagedOutputError) as e:
        load_blocks(blk.load_teacher()[1][0], [blk])
    assert len(str(e.value).splitlines()) == 1 and "block.safetensors" in str(e.value) and "SHA-256" in str(e.value)
    assert not blk.out_dir.exists() and list(blk.out_dir.parent.glob(f"{blk.out_dir.name}.damaged-*"))

    want = closure_downstream(tasks, block0)
    ok, ran = run_graph(RunExperiment(preset="", set=CFG, outputs=str(out)))
    assert ok and {r for r in ran if r[0] != "RunExperiment"} == want
    assert [r for r in ran if r[0] == "TrainBlock"] == [("TrainBlock", block0.label())]  # that block only
    assert f.read_bytes() == good and block0.complete()  # retrained to the same bytes
    assert list(block0.out_dir.parent.glob(f"{block0.out_dir.name}.damaged-*"))  # the damaged one kept aside
