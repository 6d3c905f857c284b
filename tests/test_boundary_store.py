import errno
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from zgcore.data.boundary_store import (FORMAT_VERSION, BoundaryReader, BoundaryStoreError, STATS_SEQUENCES, build_store, channel_rms,
                                   join_shards, plan_shards)
from zgcore.models.adapters import capture_boundaries
from zgcore.models.teacher import load, materialise
from bench.common import as_format_3, as_format_5


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


def test_every_sequence_is_checksummed_with_the_xxh3_its_shard_records(store):
    import xxhash

    path, _, _ = store
    files = list(path.glob("shards/*/b*.h5"))
    assert len(files) == 12  # 4 shards x 3 boundaries
    for f in files:
        with h5py.File(f, "r") as h:
            assert h["h"].chunks is None and not h["h"].fletcher32  # contiguous, unfiltered (format 4)
            assert h["xxh3"].dtype == np.uint64 and len(h["xxh3"]) == len(h["h"])
            assert [xxhash.xxh3_64_intdigest(np.ascontiguousarray(row)) for row in h["h"][...]] == h["xxh3"][...].tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_values_read_are_bitwise_those_written_for_every_storage_dtype(store, tmp_path, dtype):
    """What the teacher produced, rounded once to the storage dtype, comes back bitwise in that
    dtype (not widened: the consumer widens on its device), and ``.float()`` of it is the float32
    round trip."""
    from zgcore.data.boundary_store import TORCH_DTYPES, round_trip

    _, model, tokens = store
    build_store(tmp_path / dtype, model, tokens, [0, 4], dtype, 4, {}, shard_sequences=4, log=lambda m: None)
    ref = capture_boundaries(model, torch.from_numpy(tokens["train"].astype(np.int64)), [0, 4])
    order = [9, 3, 4, 5, 0, 8, 1, 2, 6, 7, 3]
    with BoundaryReader(tmp_path / dtype) as r:
        for b in (0, 4):
            got = r.read("train", b, order)
            want = round_trip(ref[b][order], dtype)
            assert got.dtype == TORCH_DTYPES[dtype] and got.shape == want.shape
            assert torch.equal(got.float().view(torch.int32), want.view(torch.int32))
            if dtype != "float32":
                assert torch.equal(got.view(torch.int16), ref[b][order].to(TORCH_DTYPES[dtype]).view(torch.int16))
                assert not torch.equal(got.float(), ref[b][order])  # really rounded: the test can tell the dtypes apart


def test_a_format_3_store_is_still_read_bitwise_and_an_unknown_format_is_refused_with_what_to_do(store, tmp_path):
    import shutil

    path, _, _ = store
    old = tmp_path / "old"
    shutil.copytree(path, old)
    as_format_3(old)
    idx = [9, 3, 4, 5, 0, 8]
    with BoundaryReader(path) as new, BoundaryReader(old) as r:
        assert r.version == 3 and new.version == FORMAT_VERSION == 6
        for b in (0, 2, 4):
            assert torch.equal(r.read("train", b, idx), new.read("train", b, idx))
    f = old / "shards" / "train-00000004" / "b2.h5"
    with h5py.File(f, "r") as h:
        assert h["h"].fletcher32 and "xxh3" not in h
        offset = h["h"].id.get_chunk_info(1).byte_offset
    raw = bytearray(f.read_bytes())
    raw[offset + 40] ^= 0x04  # the SHA-256 updated to match: only Fletcher32 can tell
    from zgcore.hashing import file_sha256

    was = file_sha256(f)
    f.write_bytes(bytes(raw))
    for rec in (old / "manifest.json", f.parent / "shard.json"):
        rec.write_text(rec.read_text().replace(was, file_sha256(f)))
    with BoundaryReader(old) as r, pytest.raises(BoundaryStoreError, match=f"{f.resolve()}: checksum failure"):
        r.read("train", 2, [5])
    m = json.loads((old / "manifest.json").read_text())
    m["format_version"] = 2
    (old / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BoundaryStoreError, match="format version 2 cannot be read by this code.*rebuild the cache"):
        BoundaryReader(old)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_changed_sequence_whose_file_hash_was_updated_fails_its_xxh3_naming_the_file(store, tmp_path, dtype):
    """Past the file's SHA-256 (as if the file had changed between the open and the read), each
    sequence's xxh3 still catches a changed byte, and only in the sequence that holds it."""
    from zgcore.hashing import file_sha256

    _, model, tokens = store
    build_store(tmp_path / "s", model, tokens, [2], dtype, 4, {}, shard_sequences=4, log=lambda m: None)
    f = tmp_path / "s" / "shards" / "train-00000004" / "b2.h5"
    with BoundaryReader(tmp_path / "s") as r:
        ref = r.read("train", 2, [4, 5, 7])
    with h5py.File(f, "r") as h:
        offset = h["h"].id.get_offset() + 2 * h["h"][0].nbytes + 17  # a byte of sequence 6 (row 2 of the shard)
    raw = bytearray(f.read_bytes())
    raw[offset] ^= 0x01
    was = file_sha256(f)
    f.write_bytes(bytes(raw))
    for rec in (tmp_path / "s" / "manifest.json", f.parent / "shard.json"):
        rec.write_text(rec.read_text().replace(was, file_sha256(f)))
    with BoundaryReader(tmp_path / "s") as r:
        assert torch.equal(r.read("train", 2, [4, 5, 7]), ref)  # the other sequences read as before
        with pytest.raises(BoundaryStoreError, match=f"{f.resolve()}: checksum failure: sequence 6's bytes differ"):
            r.read("train", 2, [5, 6])
    assert not f.parent.exists() and list(f.parent.parent.glob("train-00000004.damaged-*"))


def test_a_teacher_that_produces_non_finite_boundaries_fails_the_build_and_online_targets(store, tmp_path):
    import copy

    from zgcore.data.boundary_store import OnlineBoundaries

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
    """Every byte of a shard file is covered by a check that runs before its values are used,
    without hashing the whole file at open: a flip anywhere outside ``h``'s sequence data (HDF5
    metadata, the xxh3 column, statistics rows, free space) fails when the file is opened, on the
    SHA-256 of those bytes; a flip in the sequence data fails when that sequence is read, on its
    xxh3_64. Every byte of the file's first 16 KB (all of it here) and 500 seeded offsets are
    flipped; each raises BoundaryStoreError naming the file (and the shard is moved aside, so the
    next run rebuilds it) or reads identical values. None returns different values."""
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
    lo, n = json.loads((shard / "shard.json").read_text())["files"]["b2"]["data"]
    with h5py.File(f, "r") as h:  # the recorded range is h's data, and the xxh3 column lies outside it
        assert (lo, n) == (h["h"].id.get_offset(), h["h"].nbytes) and not lo <= h["xxh3"].id.get_offset() < lo + n
    offsets = set(range(min(len(raw), 16384))) | set(np.random.default_rng(0).integers(0, len(raw), 500).tolist())
    outcomes = {"same": 0, "at open": 0, "at read": 0}
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
            if lo <= off < lo + n:  # sequence data: its own xxh3 when read
                assert f"sequence {4 + (off - lo) // (n // 4)}'s bytes differ" in str(e), (off, str(e))
                outcomes["at read"] += 1
            else:
                assert "bytes outside the sequence data differs" in str(e), (off, str(e))
                outcomes["at open"] += 1
            (moved,) = list((copy / "shards").glob("train-00000004.damaged-*"))  # quarantined
            assert not shard.exists()
            moved.rename(shard)
        else:
            assert torch.equal(got, ref), f"a flip at byte {off} changed the values read"
            outcomes["same"] += 1
    f.write_bytes(raw)
    inside = sum(lo <= o < lo + n for o in offsets)
    assert len(offsets) > 500 and 0 < inside < len(offsets)
    assert outcomes == {"same": 0, "at open": len(offsets) - inside, "at read": inside}  # every flip is caught
    print(f"{len(offsets)} flips of a {len(raw)}-byte shard file: {outcomes} in {time.perf_counter() - t0:.1f} s")


def test_opening_a_format_5_file_reads_only_the_bytes_outside_its_sequence_data(store, tmp_path):
    """The open-time check never reads the sequence data: zeroing the data range after the file
    is opened in a hash-free way changes nothing the open check sees (the reads then fail on
    their xxh3), and the outside SHA-256 of a file equals that of the same file with other data."""
    from zgcore.data.boundary_store.integrity import file_record, outside_sha256

    path, _, _ = store
    f = path / "shards" / "train-00000004" / "b2.h5"
    rec = file_record(f)
    assert rec == json.loads((f.parent / "shard.json").read_text())["files"]["b2"]
    lo, n = rec["data"]
    raw = bytearray(f.read_bytes())
    raw[lo: lo + n] = bytes(n)
    other = tmp_path / "b2.h5"
    other.write_bytes(bytes(raw))
    assert outside_sha256(other, rec["data"]) == rec["outside_sha256"]
    assert file_record(other)["sha256"] != rec["sha256"]


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


@pytest.mark.parametrize("fmt", [5, 3])
@pytest.mark.parametrize("dtype,bits", [("float32", 0xFFC00000), ("bfloat16", 0xFFC0), ("bfloat16", 0x7F80),
                                        ("float16", 0xFC00), ("float16", 0x7E00)])
def test_a_non_finite_stored_value_with_valid_checksums_fails_the_read_naming_the_file(store, tmp_path, fmt, dtype, bits):
    """Formats 3 to 5 (whose writers checked values before rounding them to the storage dtype): the
    finiteness test runs on the stored bits of every dtype (16-bit: not widened first): a
    NaN or ±inf written into a shard with its checksums recomputed (so only that test can see it)
    fails the read naming the file; the finite value beside it and other shards read as before."""
    from zgcore.data.boundary_store import TORCH_DTYPES
    from zgcore.data.boundary_store.common import sequence_checksums
    from zgcore.data.boundary_store.integrity import file_record
    from zgcore.hashing import file_sha256

    _, model, tokens = store
    path = tmp_path / "s"
    build_store(path, model, tokens, [0, 2], dtype, 4, {}, shard_sequences=4, log=lambda m: None)
    (as_format_3 if fmt == 3 else as_format_5)(path)  # format 6's reader trusts its writer's check (next test)
    with BoundaryReader(path) as r:
        ref = r.read("train", 2, [0, 5])
    f = path / "shards" / "train-00000004" / "b2.h5"
    with h5py.File(f, "r+") as h:
        row = h["h"][1]
        row.view(np.uint32 if dtype == "float32" else np.uint16)[3, 7] = bits
        h["h"][1] = row
        if fmt == 5:
            h["xxh3"][1] = sequence_checksums(row[None])[0]
    for rec in (path / "manifest.json", f.parent / "shard.json"):
        m = json.loads(rec.read_text())
        for sh in [m] if rec.name == "shard.json" else [s for s in m["shards"] if Path(s["dir"]).name == f.parent.name]:
            sh["files"]["b2"].update(file_record(f) if fmt == 5 else {"bytes": f.stat().st_size, "sha256": file_sha256(f)})
        rec.write_text(json.dumps(m))
    with BoundaryReader(path) as r:
        got = r.read("train", 2, [0, 4, 6])  # rows 4 and 6 of the damaged shard are finite
        assert got.dtype == TORCH_DTYPES[dtype] and torch.equal(got[0], ref[0])
        with pytest.raises(BoundaryStoreError, match=f"{f.resolve()}: 1 non-finite value"):
            r.read("train", 2, [0, 5])
    assert not f.parent.exists() and list((path / "shards").glob("train-00000004.damaged-*"))


@pytest.mark.parametrize("where,err", [("hash", errno.ESTALE), ("h5py.File", errno.EMFILE), ("os.open", errno.EACCES),
                                       ("os.preadv", errno.EIO), ("sumsq", errno.ENOSPC)])
def test_a_file_system_error_at_open_or_read_fails_in_one_line_and_keeps_the_shard(store, tmp_path, monkeypatch, where, err):
    """An OSError of the file system (ESTALE while hashing the bytes outside the data at open, EMFILE from h5py at open, EACCES from
    os.open, EIO from os.preadv at read, ENOSPC while the join reads the statistics rows) is one
    BoundaryStoreError line naming the file and the system's error; nothing is moved aside, and
    once the file system answers the same reader code reads the same values."""
    import os
    import shutil

    from zgcore.data.boundary_store import join_shards, reader, shards

    path, _, _ = store
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    shard = copy / "shards" / "train-00000004"
    with BoundaryReader(copy) as r:
        ref = r.read("train", 2, [4, 5, 6])
    calls = []

    def failing(real):
        def f(*a, **k):
            calls.append(a)
            raise OSError(err, os.strerror(err), str(shard / "b2.h5"))
        return f

    target = {"hash": (reader, "outside_sha256"), "h5py.File": (reader.h5py, "File"), "os.open": (reader.os, "open"),
              "os.preadv": (reader.os, "preadv"), "sumsq": (shards.h5py, "File")}[where]
    monkeypatch.setattr(*target, failing(getattr(*target)))
    with pytest.raises(BoundaryStoreError) as e:
        if where == "sumsq":
            (tmp_path / "join").mkdir()
            join_shards(tmp_path / "join", sorted((copy / "shards").iterdir()), {"train": 10, "val": 3},
                        {"teacher_fingerprint": "abc"})
        else:
            with BoundaryReader(copy) as r:
                r.read("train", 2, [4, 5, 6])
    msg = str(e.value)
    assert calls and len(msg.splitlines()) == 1, msg
    assert str((shard / "b2.h5").resolve() if where != "sumsq" else copy / "shards" / "train-00000000" / "b0.h5") in msg, msg
    assert f"[Errno {err}] {os.strerror(err)}" in msg and "it is kept" in msg, msg
    assert shard.is_dir() and not list((copy / "shards").glob("*.damaged-*"))  # nothing quarantined
    monkeypatch.undo()
    with BoundaryReader(copy) as r:
        assert torch.equal(r.read("train", 2, [4, 5, 6]), ref)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_a_value_that_rounds_to_inf_in_the_storage_dtype_fails_the_build_naming_it(store, tmp_path, dtype):
    """Format 6 checks the values finite as stored (after rounding), so a read need only match each
    sequence's xxh3: a teacher whose boundary 0 reaches 1e5 (finite in float32 and bfloat16, inf in
    float16, largest finite 65504) fails a float16 build and float16 online targets naming the
    boundary and the dtype, and nothing is left as a complete store; the other dtypes build and read
    the values back finite."""
    import copy

    from zgcore.data.boundary_store import OnlineBoundaries

    _, model, tokens = store
    big = copy.deepcopy(model)
    with torch.no_grad():
        big.get_input_embeddings().weight[:, 0] = 1e5  # boundary 0 is the embedding output
    path = tmp_path / dtype
    if dtype == "float16":
        with pytest.raises(BoundaryStoreError, match=r"boundary 0, train sequences 0\.\.3, stored as float16: \d+ non-finite"):
            build_store(path, big, tokens, [0, 2], dtype, 4, {}, shard_sequences=4, log=lambda m: None)
        assert not (path / "manifest.json").exists()
        with pytest.raises(BoundaryStoreError, match=r"boundary 0 \(online targets, as float16\)"):
            OnlineBoundaries(big, tokens["train"], [0, 2], dtype, 4)
        return
    build_store(path, big, tokens, [0, 2], dtype, 4, {}, shard_sequences=4, log=lambda m: None)
    with BoundaryReader(path) as r:
        got = r.read("train", 0, np.arange(r.n("train")))
        assert r.version == 6 and bool(torch.isfinite(got.float()).all()) and float(got.float().abs().max()) >= 9.9e4


def test_a_shard_damaged_twice_in_one_second_is_set_aside_twice(tmp_path, monkeypatch):
    # the second copy must not land on (a folder: fail to rename onto; a file: replace) the first
    import time

    from zgcore.data.boundary_store import quarantine
    from zgcore.data.boundary_store.common import quarantine_file

    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)
    moved = []
    for i in range(3):
        (tmp_path / "shard").mkdir()
        (tmp_path / "shard" / "b0.h5").write_text(str(i))
        moved.append(quarantine(tmp_path / "shard"))
        (tmp_path / "f.h5").write_text(str(i))
        moved.append(quarantine_file(tmp_path / "f.h5"))
    assert None not in moved and len(set(moved)) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "f.h5.damaged-1800000000", "f.h5.damaged-1800000000-2", "f.h5.damaged-1800000000-3",
        "shard.damaged-1800000000", "shard.damaged-1800000000-2", "shard.damaged-1800000000-3"]
    assert [(tmp_path / f"f.h5.damaged-1800000000{s}").read_text() for s in ("", "-2", "-3")] == ["0", "1", "2"]
