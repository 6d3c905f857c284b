"""The sharded teacher cache on a tiny teacher: identity across shard counts, locality of a block's
reads, lazy teacher layers, resumable builds, checksums and non-finite boundaries."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import luigi
import numpy as np
import pytest
import torch

from tests.conftest import tiny_cfg
from workflows import RunExperiment
from workflows.cli import walk
from workflows.experiment import build_experiment, load_config
from zgcore.data.boundary_store import BoundaryReader

ROOT = Path(__file__).resolve().parents[1]
ONE = tiny_cfg()  # 86 train + 10 val sequences: one train shard and one val shard
FOUR = tiny_cfg(**{"boundary.shard_sequences": 32})  # train 0-32, 32-64, 64-86 and val 0-10: statistics span two
FAILURES: list[tuple[str, str]] = []


@luigi.Task.event_handler(luigi.Event.FAILURE)
def _record_failure(task, exc):
    FAILURES.append((task.get_task_family(), str(exc)))


def tasks_of(cfg, out, family):
    return [t for t in walk(build_experiment(load_config(overrides=cfg, preset=""), str(out))) if t.get_task_family() == family]


def blocks(out):
    return {p.parent.name.rsplit("-", 1)[0]: p.read_bytes() for p in sorted(Path(out).glob("TrainBlock/*/block.safetensors"))}


def store_bytes(out, cfg):
    """Every boundary of both splits read through the store, and every statistics file, as bytes."""
    tb = tasks_of(cfg, out, "TeacherBoundary")[0]
    with BoundaryReader(tb.out_dir) as r:
        data = {(s, b): r.read(s, b, np.arange(r.n(s))).numpy().tobytes() for s in ("train", "val")
                for b in r.manifest["boundaries"]}
        stats = {b: r.stats(b).numpy().tobytes() for b in r.manifest["boundaries"]}
        return data, stats, r.manifest


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The same experiment built with one train shard and with four shards."""
    d = tmp_path_factory.mktemp("shards")
    for name, cfg in (("one", ONE), ("four", FOUR)):
        res = luigi.build([RunExperiment(preset="", set=cfg, outputs=str(d / name))], local_scheduler=True,
                          log_level="WARNING", detailed_summary=True)
        assert res.scheduling_succeeded
    return d / "one", d / "four"


def test_one_and_four_shards_give_identical_boundaries_statistics_and_blocks(built):
    one, four = built
    d1, s1, m1 = store_bytes(one, ONE)
    d4, s4, m4 = store_bytes(four, FOUR)
    assert (m1["n_shards"], m4["n_shards"]) == (2, 4)
    assert d1 == d4 and s1 == s4  # every boundary and every statistic, byte for byte
    assert blocks(one) == blocks(four) and len(blocks(one)) == 2
    # the shard plan is how the build is split, not what it holds: same cache name, same block names
    assert [t.out_dir.name for t in tasks_of(ONE, one, "TrainBlock")] == [t.out_dir.name for t in tasks_of(FOUR, four, "TrainBlock")]
    assert sorted(s["split"] + str(s["lo"]) for s in m4["shards"]) == ["train0", "train32", "train64", "val0"]
    for s in m4["shards"]:  # the manifest records each shard file's size and checksum
        for f in s["files"].values():
            assert len(f["sha256"]) == 64 and f["bytes"] > 0
    assert m4["build_seconds"] > 0 and m4["build_wall_seconds"] > 0


def test_a_train_block_opens_only_its_two_boundaries_and_its_kept_layers(built, monkeypatch, run_graph):
    import shutil

    import zgcore.models.teacher
    import zgcore.models.teacher_weights as tw

    _, four = built
    # train.prefetch=0 (not hashed: the same task) reads in this process, where the recorder sees the files opened
    block1 = tasks_of(FOUR + " train.prefetch=0", four, "TrainBlock")[1]
    before = block1.out_dir.joinpath("block.safetensors").read_bytes()
    shutil.rmtree(block1.out_dir)
    opened, layers = [], []

    class Recorder(h5py.File):
        def __init__(self, name, *a, **k):
            opened.append(Path(name).resolve())
            super().__init__(name, *a, **k)

    real_layers = tw.LazyLayers.layer_weights
    monkeypatch.setattr(h5py, "File", Recorder)
    monkeypatch.setattr(tw.LazyLayers, "layer_weights", lambda self, i: layers.append(i) or real_layers(self, i))
    for name in ("load_base",):
        monkeypatch.setattr(tw, name, lambda *a, **k: pytest.fail("a cached TrainBlock loaded the teacher"))
    monkeypatch.setattr(zgcore.models.teacher, "load", lambda *a, **k: pytest.fail("a cached TrainBlock loaded the teacher"))
    ok, ran = run_graph(block1)
    assert ok and ran == [("TrainBlock", "block1-clean-cached-s0")]
    shard_dirs = sorted(p.resolve() for p in (four / "BoundaryShard").glob("train-*"))
    assert len(shard_dirs) == 3
    assert set(opened) == {d / f"b{b}.h5" for d in shard_dirs for b in (2, 4)}  # boundaries 2 and 4, train only
    kept = json.loads(block1.out_dir.joinpath("metrics.json").read_text())["kept"]
    assert layers == kept and all(2 <= i < 4 for i in kept)  # only its partition's kept layers were read
    assert block1.out_dir.joinpath("block.safetensors").read_bytes() == before


def test_an_aux_term_block_reads_only_its_layers_and_the_head_and_declares_the_token_store(built, monkeypatch, run_graph):
    """Local CE / MTP terms need the teacher's final norm and LM head and the token ids: a cached
    block with them reads its kept layers and the non-layer tensors only (never the whole
    teacher), and declares PrepareCorpus (tokens.h5) in requires()."""
    import zgcore.models.teacher
    import zgcore.models.teacher_weights as tw

    _, four = built
    # train.prefetch=0 (not hashed): the shards are read in this process, where the recorder sees them opened
    cfg = FOUR + " blocks.1.ce_weight=0.1 blocks.1.mtp_weight=0.1 train.prefetch=0"
    block1 = tasks_of(cfg, four, "TrainBlock")[1]
    corpus_task = tasks_of(cfg, four, "PrepareCorpus")[0]
    assert block1.requires()["corpus"].out_dir == corpus_task.out_dir  # the token store it reads is declared
    assert "corpus" not in tasks_of(cfg, four, "TrainBlock")[0].requires()  # block 0 has no aux term
    opened, layers, others = [], [], []

    class Recorder(h5py.File):
        def __init__(self, name, *a, **k):
            opened.append(Path(name).resolve())
            super().__init__(name, *a, **k)

    real_layers, real_others = tw.LazyLayers.layer_weights, tw.LazyLayers.other_weights
    monkeypatch.setattr(h5py, "File", Recorder)
    monkeypatch.setattr(tw.LazyLayers, "layer_weights", lambda self, i: layers.append(i) or real_layers(self, i))
    monkeypatch.setattr(tw.LazyLayers, "other_weights", lambda self: others.append(sorted(real_others(self))) or real_others(self))
    monkeypatch.setattr(tw, "load_base", lambda *a, **k: pytest.fail("a cached TrainBlock loaded the teacher"))
    monkeypatch.setattr(zgcore.models.teacher, "load", lambda *a, **k: pytest.fail("a cached TrainBlock loaded the teacher"))
    ok, ran = run_graph(block1)
    assert ok and ran == [("TrainBlock", "block1-clean-cached-s0")]
    kept = json.loads(block1.out_dir.joinpath("metrics.json").read_text())["kept"]
    assert layers == kept and all(2 <= i < 4 for i in kept)  # only its partition's kept layers
    assert len(others) == 1 and not any(".layers." in k for k in others[0])  # embedding, norm, head: no layer
    assert {k.rsplit(".", 1)[0] for k in others[0]} >= {"model.embed_tokens", "model.norm"}
    shard_dirs = sorted(p.resolve() for p in (four / "BoundaryShard").glob("train-*"))
    want = {d / f"b{b}.h5" for d in shard_dirs for b in (2, 4)} | {(corpus_task.out_dir / "tokens.h5").resolve()}
    assert set(opened) == want


def test_a_flipped_byte_fails_the_read_naming_the_shard_and_only_that_shard_is_rebuilt(built, run_graph):
    one, four = built
    shard = next(p for p in (four / "BoundaryShard").glob("train-00000032-*"))
    f = shard / "b2.h5"
    with h5py.File(f, "r") as h:
        offset = h["h"].id.get_offset() + 5 * h["h"][0].nbytes  # contiguous: sequence 5's bytes
    raw = bytearray(f.read_bytes())
    raw[offset + 100] ^= 0x10
    f.write_bytes(bytes(raw))  # same size: only the checksum can tell
    FAILURES.clear()
    ok, _ = run_graph(RunExperiment(preset="", set=FOUR + " blocks.1.lr=0.003", outputs=str(four)))
    assert not ok
    msgs = [m for fam, m in FAILURES if fam == "TrainBlock"]
    assert msgs and str(f.resolve()) in msgs[0] and "checksum" in msgs[0]
    ok, ran = run_graph(RunExperiment(preset="", set=FOUR + " blocks.1.lr=0.003", outputs=str(four)))
    assert ok
    assert [label for fam, label in ran if fam == "BoundaryShard"] == [shard.name.rsplit("-", 1)[0]]
    assert list((four / "BoundaryShard").glob(f"{shard.name}.damaged-*"))
    assert store_bytes(four, FOUR)[0] == store_bytes(one, ONE)[0]  # rebuilt to the same bytes


def test_a_nan_in_a_checksummed_boundary_fails_the_block_that_reads_it(built, run_graph):
    """A NaN placed in a shard with every checksum and SHA-256 recomputed (as if the teacher had
    written it) never trains anything. A format-6 writer checks its stored values finite, so its
    reader trusts a sequence whose xxh3 matches: the NaN reaches the block, whose loss turns
    non-finite and fails the task (NonFiniteError) before any result is kept."""
    _, four = built
    f = next((four / "BoundaryShard").glob("train-00000064-*")) / "b4.h5"
    from zgcore.data.boundary_store import sequence_checksums

    with h5py.File(f, "r+") as h:  # the sequence's xxh3 recomputed too: only finiteness can tell
        row = h["h"][3]
        row[7, 5] = np.nan
        h["h"][3] = row
        h["xxh3"][3] = sequence_checksums(row[None])[0]
    # as if the teacher had written it so: the recorded SHA-256s match the file, only finiteness can tell
    from zgcore.data.boundary_store.integrity import file_record

    old, new = json.loads(f.parent.joinpath("shard.json").read_text())["files"]["b4"], file_record(f)
    for rec in (*four.glob("TeacherBoundary/*/manifest.json"), f.parent / "shard.json"):
        rec.write_text(rec.read_text().replace(old["sha256"], new["sha256"])
                       .replace(old["outside_sha256"], new["outside_sha256"]))
    FAILURES.clear()
    cfg = FOUR + " blocks.1.lr=0.004 blocks.1.max_steps=22"  # 22 batches of 4: every training sequence is read
    ok, ran = run_graph(RunExperiment(preset="", set=cfg, outputs=str(four)))
    assert not ok
    msgs = [m for fam, m in FAILURES if fam == "TrainBlock"]
    assert msgs and "the loss is nan" in msgs[0] and "a non-finite boundary or token" in msgs[0]
    assert not tasks_of(cfg, four, "TrainBlock")[1].out_dir.exists()  # nothing trained on it was kept


def test_sigkill_during_the_build_reruns_only_the_unfinished_shards(tmp_path, run_graph):
    cfg = tiny_cfg(**{"corpus.max_tokens": 8192, "boundary.shard_sequences": 8, "train.max_steps": 2})
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "luigi", "--module", "workflows", "RunExperiment", "--local-scheduler", "--preset", "",
           "--outputs", str(out), "--set", cfg]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    done = []
    while time.time() < deadline and proc.poll() is None:
        done = [p for p in (out / "BoundaryShard").glob("*") if (p / "shard.json").is_file()] if (out / "BoundaryShard").is_dir() else []
        if len(done) >= 2:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = {p.name.rsplit("-", 1)[0] for p in (out / "BoundaryShard").glob("*") if (p / "shard.json").is_file()}
    plan = {t.label() for t in tasks_of(cfg, out, "BoundaryShard")}
    assert len(plan) == 33 and 2 <= len(finished) < len(plan), "the kill did not land inside the build"
    assert not list(out.glob("TeacherBoundary/*"))
    ok, ran = run_graph(RunExperiment(preset="", set=cfg, outputs=str(out)))
    assert ok
    rebuilt = [label for fam, label in ran if fam == "BoundaryShard"]
    assert sorted(rebuilt) == sorted(plan - finished)  # the finished shards were not built again


def test_lazy_layers_and_a_truncated_teacher_give_the_full_teachers_bytes(tmp_path):
    from zgcore.models.adapters import build_block, capture_boundaries
    from zgcore.models.teacher import load, materialise
    from zgcore.models.teacher_weights import LazyLayers, load_base

    rec = materialise("tiny-qwen2", outputs=tmp_path)
    full, _ = load(rec)
    lazy = build_block(LazyLayers(rec), [1, 3], "teacher", 0).layer_state_dict()
    eager = build_block(full, [1, 3], "teacher", 0).layer_state_dict()
    assert lazy.keys() == eager.keys() and all(torch.equal(lazy[k], eager[k]) for k in lazy)
    base = load_base(rec, 2)
    assert len(base.layers) == 2 and not hasattr(base, "lm_head")  # never the LM head, no layer past 2
    ids = torch.randint(0, 256, (2, 16))
    want, got = capture_boundaries(full, ids, [0, 1, 2]), capture_boundaries(base, ids, [0, 1, 2])
    assert all(torch.equal(want[b], got[b]) for b in want)
    assert next(load_base(rec, 4, "bfloat16").parameters()).dtype == torch.bfloat16


def test_online_targets_load_the_teacher_only_up_to_the_blocks_output_boundary(tmp_path, monkeypatch, run_graph):
    import zgcore.models.teacher_weights as tw

    asked = []
    real = tw.load_base
    monkeypatch.setattr(tw, "load_base", lambda rec, n, *a, **k: asked.append(n) or real(rec, n, *a, **k))
    cfg = tiny_cfg(**{"train.targets": "online", "train.max_steps": 2})
    block0 = tasks_of(cfg, tmp_path, "TrainBlock")[0]
    ok, _ = run_graph(block0)
    assert ok and asked == [2]  # block 0 maps boundary 0 to boundary 2 of a 4-layer teacher


def test_cache_hash_covers_teacher_dtype_but_not_the_shard_plan(tmp_path):
    base = tasks_of(ONE, tmp_path, "TeacherBoundary")[0].uid
    assert tasks_of(FOUR, tmp_path, "TeacherBoundary")[0].uid == base
    assert tasks_of(ONE + " boundary.teacher_dtype=bfloat16", tmp_path, "TeacherBoundary")[0].uid != base
    online = tiny_cfg(**{"train.targets": "online"})
    assert tasks_of(online, tmp_path, "TrainBlock")[0].uid != \
        tasks_of(online + " boundary.teacher_dtype=float16", tmp_path, "TrainBlock")[0].uid


@pytest.mark.parametrize("over,msg", [("boundary.shard_sequences=0", "shard_sequences must be a positive"),
                                      ("boundary.shard_sequences=12", "multiple of boundary.batch_size"),
                                      ("boundary.teacher_dtype=float64", "teacher_dtype must be one of")])
def test_bad_shard_size_or_teacher_dtype_fails_before_any_task(tmp_path, over, msg):
    from zgcore.checks import ConfigError

    with pytest.raises(ConfigError, match=msg):
        load_config(overrides=tiny_cfg() + " " + over, preset="")


def test_a_bfloat16_teacher_builds_its_own_cache_close_to_float32(tmp_path, run_graph):
    caches = {}
    for dt in ("float32", "bfloat16"):
        cfg = ONE + f" boundary.teacher_dtype={dt}"
        tb = tasks_of(cfg, tmp_path, "TeacherBoundary")[0]
        assert run_graph(tb)[0]
        with BoundaryReader(tb.out_dir) as r:
            assert r.manifest["teacher_dtype"] == dt and r.manifest["dtype"] == "float32"  # storage stays its own
            caches[dt] = r.read("train", 4, np.arange(8))
    a, b = caches["float32"], caches["bfloat16"]
    assert not torch.equal(a, b) and ((a - b).norm() / a.norm()) < 0.05  # run in bf16: close, not equal


def test_a_shard_build_shows_a_progress_bar_of_sequences(tmp_path, capsys, monkeypatch):
    """A teacher pass over a shard is the long part of a cache build: it shows a bar counting sequences
    (the bar a terminal gets: ``ZG_PROGRESS=bar``; a log file gets a line per tenth, zgcore/progress.py)."""
    from zgcore.data.boundary_store import write_shard

    monkeypatch.setenv("ZG_PROGRESS", "bar")
    from zgcore.models.teacher import load, materialise

    rec = materialise("tiny-qwen2", outputs=tmp_path)
    teacher, _ = load(rec)
    rows = np.random.default_rng(0).integers(0, 256, (5, 8))
    (tmp_path / "shard").mkdir()
    r = write_shard(tmp_path / "shard", teacher, rows, "val", 0, [0, 1], "float32", 2, {}, desc="BoundaryShard val-0-5")
    err = capsys.readouterr().err
    assert r["hi"] == 5 and "BoundaryShard val-0-5" in err and "5/5" in err and "seq" in err
