"""The top-k logit store as tasks on a tiny teacher: Heal and DistillE2E trained from it are
byte-identical to the same top-k loss with the teacher online, never load the teacher, and a
damaged or interrupted logit shard is found, quarantined and rebuilt alone."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from tests.conftest import tiny_cfg
from workflows.experiment import block_settings, build_experiment, load_config

ROOT = Path(__file__).resolve().parents[1]
HEAL = {"heal.steps": 3, "heal.lr": 1e-3, "heal.batch_size": 2, "heal.top_k": 8, "heal.checkpoint_every": 2}
def heal_task(out, **over):
    cfg = load_config("", tiny_cfg(**{**HEAL, **over}), "")
    return build_experiment(cfg, str(out)).requires()["assemble"]


def e2e_task(out, **over):
    from tasks.distill import DistillE2E

    cfg = load_config("", tiny_cfg(**{"distill.steps": 3, "distill.batch_size": 2, "distill.lr": 1e-3,
                                      "distill.top_k": 8, "distill.hidden_weight": 0, **over}), "")
    return DistillE2E(teacher=cfg["teacher"], corpus=cfg["corpus"], boundary=cfg["boundary"], blocks=block_settings(cfg),
                      distill=cfg["distill"], outputs=str(out), device="cpu")


def weights(task) -> bytes:
    return (task.out_dir / "model" / "model.safetensors").read_bytes()


@pytest.fixture
def no_teacher(monkeypatch):
    """Count every call that loads the teacher's layers (whole, or a truncated base model)."""
    import zgcore.models.teacher
    import zgcore.models.teacher_weights as tw

    calls = []
    real_load, real_base = zgcore.models.teacher.load, tw.load_base
    monkeypatch.setattr(zgcore.models.teacher, "load", lambda *a, **k: calls.append("load") or real_load(*a, **k))
    monkeypatch.setattr(tw, "load_base", lambda *a, **k: calls.append("load_base") or real_base(*a, **k))
    return calls


def test_cached_top_k_heal_is_byte_identical_to_online_and_never_loads_the_teacher(tmp_path, run_graph, no_teacher):
    online, cached = heal_task(tmp_path, **{"heal.targets": "online"}), heal_task(tmp_path, **{"heal.targets": "cached"})
    full = heal_task(tmp_path, **{"heal.top_k": 0})
    assert online.uid != cached.uid and "logits" in cached.requires() and "logits" not in online.requires()
    ok, _ = run_graph(online, full, cached.requires()["logits"])
    assert ok and no_teacher  # the online run and the store's build load the teacher
    no_teacher.clear()
    ok, ran = run_graph(cached)
    assert ok and ran == [("Heal", "healed-3-top8-cached")]
    assert no_teacher == []  # counted: the cached run never loaded the teacher
    assert weights(cached) == weights(online)  # byte-identical healed students
    assert weights(full) != weights(online)  # the top-k loss is not the full-vocabulary one
    assert (cached.out_dir / "loss_log.csv").read_text() == (online.out_dir / "loss_log.csv").read_text()
    man = json.loads((cached.requires()["logits"].out_dir / "manifest.json").read_text())
    assert man["kind"] == "topk-logits" and man["top_k"] == 8 and man["hidden_size"] == 17
    assert man["n_train"] == 86 and man["bytes"] >= (86 + 10) * 32 * 68 and man["build_seconds"] > 0
    # cached without top_k, or with the hidden-state term, fails before any task with what to set
    from zgcore.checks import ConfigError

    with pytest.raises(ConfigError, match="heal.top_k = 64"):
        heal_task(tmp_path, **{"heal.targets": "cached", "heal.top_k": 0})
    with pytest.raises(ConfigError, match="hidden_weight=0"):
        heal_task(tmp_path, **{"heal.targets": "cached", "heal.hidden_weight": 0.5})


def test_cached_top_k_e2e_arm_is_byte_identical_to_online_and_reads_only_the_students_weights(tmp_path, run_graph,
                                                                                            no_teacher, monkeypatch):
    import zgcore.models.teacher_weights as tw

    online, cached = e2e_task(tmp_path, **{"distill.targets": "online"}), e2e_task(tmp_path, **{"distill.targets": "cached"})
    ok, _ = run_graph(online, cached.requires()["logits"])
    assert ok
    no_teacher.clear()
    layers = []
    real = tw.LazyLayers.layer_weights
    monkeypatch.setattr(tw.LazyLayers, "layer_weights", lambda self, i: layers.append(i) or real(self, i))
    ok, ran = run_graph(cached)
    assert ok and [f for f, _ in ran] == ["DistillE2E"]
    assert no_teacher == []
    student_layers = json.loads((cached.out_dir / "metrics.json").read_text())["student_layers"]
    assert len(layers) == student_layers == 2  # the kept layers only (one per block of the 4-layer teacher)
    assert weights(cached) == weights(online)


def _flip(path: Path, where: str) -> int:
    with h5py.File(path, "r") as f:
        offset = {"header": 64, "data": f["h"].id.get_offset() + f["h"][0].nbytes * 40 + 123,
                  "checksums": f["xxh3"].id.get_offset() + 8 * 40 + 3}[where]
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x08
    path.write_bytes(bytes(raw))  # same size: only the checks can tell
    return offset


@pytest.mark.parametrize("where", ["header", "data", "checksums"])
def test_a_flipped_byte_in_a_logit_shard_fails_naming_the_file_and_only_that_shard_is_rebuilt(tmp_path, run_graph, where):
    from zgcore.data.boundary_store import BoundaryStoreError

    # every training sequence is read: two steps of 43
    over = {"heal.targets": "cached", "heal.batch_size": 43, "heal.steps": 2}
    task = heal_task(tmp_path, **over)
    ok, _ = run_graph(task.requires()["assemble"], task.requires()["logits"])  # every input of the Heal
    assert ok
    shard = next((tmp_path / "TeacherLogits").glob("train-*"))
    f = shard / "b0.h5"
    _flip(f, where)
    # damaged while the task reads it (after the scheduler found its inputs complete): the task fails
    # naming the file, and the shard is moved aside (a flipped data byte when its sequence is read,
    # possibly after a first step: run outside a Luigi worker, progress reports go nowhere)
    task.set_progress_percentage = task.set_status_message = lambda *a: None
    with pytest.raises(BoundaryStoreError, match=re.escape(str(f.resolve()))):
        task.run()
    assert len(list((tmp_path / "TeacherLogits").glob(f"{shard.name}.damaged-*"))) == 1
    ok, ran = run_graph(task)
    assert ok and [label for fam, label in ran if fam == "TeacherLogits"] == [shard.name.rsplit("-", 1)[0]]
    assert ("Heal", task.label()) in ran
    # damaged at rest: complete() reads no shard data (the store checks what it reads, as the boundary
    # store does), so the run that reads it fails naming the file and moves that shard aside; the next
    # run rebuilds that shard alone
    _flip(f, where)
    again = heal_task(tmp_path, **{**over, "heal.lr": 2e-3})
    assert again.requires()["logits"].complete()
    ok, _ = run_graph(again)
    assert not ok and len(list((tmp_path / "TeacherLogits").glob(f"{shard.name}.damaged-*"))) == 2
    ok, ran = run_graph(again)
    assert ok and [label for fam, label in ran if fam == "TeacherLogits"] == [shard.name.rsplit("-", 1)[0]]


def test_sigkill_during_the_logit_store_build_reruns_only_the_unfinished_shards(tmp_path, run_graph):
    over = {"corpus.max_tokens": 8192, "boundary.shard_sequences": 8, "heal.targets": "cached"}
    task = heal_task(tmp_path, **over).requires()["logits"]
    script = ("import sys, luigi; from tests.test_logit_tasks import heal_task; "
              f"luigi.build([heal_task(sys.argv[1], **{over!r}).requires()['logits']], local_scheduler=True)")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, root = time.time() + 300, tmp_path / "TeacherLogits"
    while time.time() < deadline and proc.poll() is None:
        if root.is_dir() and len([p for p in root.glob("*") if (p / "shard.json").is_file()]) >= 2:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = {p.name.rsplit("-", 1)[0] for p in root.glob("*") if (p / "shard.json").is_file()}
    plan = {t.label() for t in task.shard_tasks()}
    assert len(plan) == 33 and 2 <= len(finished) < len(plan), "the kill did not land inside the build"
    assert not list(tmp_path.glob("TeacherLogitStore/*-*[0-9a-f]"))
    ok, ran = run_graph(task)
    assert ok
    assert sorted(label for fam, label in ran if fam == "TeacherLogits") == sorted(plan - finished)


def test_the_tiny_preset_heals_from_the_store_and_the_report_gives_its_cost(tmp_path, run_graph):
    root = build_experiment(load_config("", "", "heal_topk_tiny"), str(tmp_path))
    ok, ran = run_graph(root)
    assert ok and ("TeacherLogitStore", "logits-top8-T1") in ran and ("Heal", "healed-3-top8-cached") in ran
    rep = json.loads((root.out_dir / "report.json").read_text())
    c = rep["logit_store"]
    assert c["top_k"] == 8 and c["shards"] == 2 and c["build_seconds"] > 0
    assert 68 <= c["bytes_per_token"] < 68 * 2  # the record's 68 bytes, HDF5 and checksums on top
    assert "## Top-k logit store" in (root.out_dir / "report.md").read_text()
