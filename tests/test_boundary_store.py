import json

import h5py
import numpy as np
import pytest
import torch

from zgcore.boundary_store import (BoundaryReader, BoundaryStoreError, STATS_SEQUENCES, build_store, channel_rms,
                                   join_shards, plan_shards)
from zgcore.adapters import capture_boundaries
from zgcore.teacher import load, materialise


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("store")
    model, _ = load(materialise("tiny-llama", outputs=d))
    rng = np.random.default_rng(0)
    tokens = {"train": rng.integers(0, 256, (10, 16)).astype(np.int32), "val": rng.integers(0, 256, (3, 16)).astype(np.int32)}
    path = d / "store"
    build_store(path, model, tokens, [0, 2, 4], "float32", 4, {"teacher_fingerprint": "abc"}, shard_sequences=4,
                log=lambda m: None)
    return path, model, tokens


def test_store_holds_exact_teacher_boundaries(store):
    path, model, tokens = store
    ids = torch.from_numpy(tokens["train"][[7, 2, 7]].astype(np.int64))
    ref = capture_boundaries(model, ids, [0, 2, 4])
    with BoundaryReader(path, expect={"teacher_fingerprint": "abc", "boundaries": [0, 2, 4]}) as r:
        assert r.n("train") == 10 and r.n("val") == 3 and r.manifest["n_shards"] == 4  # 3 train shards + 1 val
        for b in (0, 2, 4):
            assert torch.equal(r.read("train", b, [7, 2, 7]), ref[b])  # any order, repeats, across shards: exact bytes
        st = r.stats(4)
        assert st.shape == (2, model.config.hidden_size) and (st > 0).all()
        # the statistics are the one channel_rms over the first STATS_SEQUENCES training sequences
        all_train = capture_boundaries(model, torch.from_numpy(tokens["train"][:STATS_SEQUENCES].astype(np.int64)), [4])[4]
        assert torch.equal(st, channel_rms(all_train))
        batches = list(r.batches("train", 0, 2, np.arange(10), 4))
        assert [k for k, _, _ in batches] == [0, 1, 2] and batches[-1][1].shape[0] == 2


def test_plan_shards_tiles_each_split():
    assert plan_shards({"train": 10, "val": 3}, 4) == [("train", 0, 4), ("train", 4, 8), ("train", 8, 10), ("val", 0, 3)]
    with pytest.raises(ValueError, match="at least 1"):
        plan_shards({"train": 10, "val": 3}, 0)


def test_manifest_mismatch_and_truncation_are_detected(store, tmp_path):
    import shutil

    path, _, _ = store
    with pytest.raises(BoundaryStoreError, match="teacher_fingerprint"):
        BoundaryReader(path, expect={"teacher_fingerprint": "other"})
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    f = next(copy.glob("shards/train-00000004/b2.h5"))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with BoundaryReader(copy) as r, pytest.raises(BoundaryStoreError, match="train-00000004/b2.h5"):
        r.read("train", 2, [5])


def test_shards_that_disagree_are_refused_by_the_join(store, tmp_path):
    import shutil

    path, _, _ = store
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    shards = sorted(p for p in (copy / "shards").iterdir())
    rec_path = shards[1] / "shard.json"
    rec = json.loads(rec_path.read_text())
    rec["hidden_size"] = 64
    rec_path.write_text(json.dumps(rec))
    out = tmp_path / "join"
    out.mkdir()
    with pytest.raises(BoundaryStoreError, match=f"{shards[1].name}.*hidden_size"):
        join_shards(out, shards, {"train": 10, "val": 3}, {"teacher_fingerprint": "abc"})
    rec["hidden_size"] = 32
    rec["teacher_fingerprint"] = "other"
    rec_path.write_text(json.dumps(rec))
    with pytest.raises(BoundaryStoreError, match="teacher_fingerprint"):
        join_shards(out, shards, {"train": 10, "val": 3}, {"teacher_fingerprint": "abc"})
    with pytest.raises(BoundaryStoreError, match="do not tile"):
        join_shards(out, [s for s in shards if s != shards[1]], {"train": 10, "val": 3}, {})


def test_every_boundary_dataset_is_checksummed(store):
    path, _, _ = store
    for f in path.glob("shards/*/b*.h5"):
        with h5py.File(f, "r") as h:
            assert h["h"].fletcher32 and h["h"].chunks == (1, 16, 32)


def test_a_teacher_that_produces_non_finite_boundaries_fails_the_build_and_online_targets(store, tmp_path):
    import copy

    from zgcore.boundary_store import OnlineBoundaries

    _, model, tokens = store
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.model.layers[1].mlp.down_proj.weight[0, 0] = float("inf")
    with pytest.raises(BoundaryStoreError, match="boundary 2, train sequences 0..3.*non-finite"):
        build_store(tmp_path / "s", broken, tokens, [0, 2, 4], "float32", 4, {}, log=lambda m: None)
    assert not (tmp_path / "s").exists()  # nothing partial under the final name
    with pytest.raises(BoundaryStoreError, match="non-finite"):
        OnlineBoundaries(broken, tokens["train"], [0, 2], "float32", 4)


def test_every_flipped_byte_of_a_shard_file_reads_the_same_values_or_fails_naming_the_file(store, tmp_path):
    """Every byte of a shard file, HDF5 metadata included, is covered by a check that runs before
    its values are used: a flip anywhere in the file's first 16 KB (all of it here), and at 500
    seeded offsets, either reads identical values or raises BoundaryStoreError naming the file,
    and the shard is moved aside (so the next run rebuilds it). None returns different values."""
    import shutil
    import time

    path, _, _ = store
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    shard = copy / "shards" / "train-00000004"
    f = shard / "b2.h5"
    rows = list(range(4, 8))
    with BoundaryReader(copy) as r:
        ref = r.read("train", 2, rows)
    raw = f.read_bytes()
    offsets = set(range(min(len(raw), 16384))) | set(np.random.default_rng(0).integers(0, len(raw), 500).tolist())
    outcomes = {"same": 0, "error": 0}
    t0 = time.perf_counter()
    for off in sorted(offsets):
        bad = bytearray(raw)
        bad[off] ^= 0xFF
        f.write_bytes(bad)
        try:
            with BoundaryReader(copy) as r:
                got = r.read("train", 2, rows)
        except BoundaryStoreError as e:
            assert str(f.resolve()) in str(e), (off, str(e))
            (moved,) = list((copy / "shards").glob("train-00000004.damaged-*"))  # quarantined
            assert not shard.exists()
            moved.rename(shard)
            outcomes["error"] += 1
        else:
            assert torch.equal(got, ref), f"a flip at byte {off} changed the values read"
            outcomes["same"] += 1
    f.write_bytes(raw)
    assert len(offsets) > 500 and outcomes == {"same": 0, "error": len(offsets)}  # the SHA-256 catches every flip
    print(f"{len(offsets)} flips of a {len(raw)}-byte shard file: {outcomes} in {time.perf_counter() - t0:.1f} s")


def test_a_flipped_byte_in_a_statistics_file_fails_naming_it_and_moves_it_aside(store, tmp_path):
    import shutil

    path, _, _ = store
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    with BoundaryReader(copy) as r:
        ref = r.stats(2)
    f = copy / "stats-b2.npy"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x01  # a low bit of the last float: a plausible value, only the hash can tell
    f.write_bytes(raw)
    with BoundaryReader(copy) as r, pytest.raises(BoundaryStoreError, match=f"{f}: checksum failure"):
        r.stats(2)
    assert not f.exists() and list(copy.glob("stats-b2.npy.damaged-*"))
    assert torch.equal(BoundaryReader(path).stats(2), ref)
