"""Boundary codecs (boundary.codec): each round-trips within its stated bound, keeps a massive channel, reads
back through the store bitwise as encoded, is covered by the store's checksums, and gives online targets
bitwise equal to cached ones."""

import json
from pathlib import Path

import h5py
import numpy as np
import re

import pytest
import torch

from tests.conftest import tiny_cfg
from zgcore.data.boundary_store import BoundaryReader, BoundaryStoreError, join_shards, write_shard
from zgcore.data.boundary_store.codec import NAMES, Codec, make
from zgcore.data.boundary_store.integrity import check_store
from zgcore.data.feed import stored_batch_bytes
from zgcore.models.teacher import load, materialise

CODECS = NAMES[1:]
# relative MSE each codec must reach on Gaussian channels (positions >= 1, outside the kept channels)
REL_MSE = {"fp8": 2e-3, "int8": 1e-4, "int4": 3e-2}


def residual(n=3, t=16, hidden=64, seed=0, massive=None):
    """Gaussian boundaries with position 0 (the attention sink) 50x the rest; ``massive``: channel at 1e4x."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, t, hidden, generator=g)
    h[:, 0] *= 50
    if massive is not None:
        h[:, :, massive] *= 1e4
    return h


def rel_mse(a, b):
    return float((a - b).pow(2).mean() / b.pow(2).mean())


@pytest.mark.parametrize("name", CODECS)
def test_each_codec_round_trips_within_its_stated_bound_at_its_stated_bits(name):
    h = residual()
    c = make(name, 16, 64, keep=4)
    codes, scales = c.encode(h)
    assert codes.dtype == torch.uint8 and codes.shape == (3, c.sequence_bytes) and bool(torch.isfinite(scales).all())
    assert c.bits == pytest.approx(8 * c.sequence_bytes / (16 * 64))
    d = c.decode(codes)
    assert d.shape == h.shape and d.dtype == torch.float32
    assert bool(((d - h).abs() <= c.bound(h)).all())
    assert torch.equal(d[:, 0], h[:, 0].bfloat16().float())  # position 0 apart, in bfloat16
    assert rel_mse(d[:, 1:], h[:, 1:]) < REL_MSE[name]
    # one sequence's bytes never depend on the batch it was encoded in
    assert torch.equal(c.encode(h[1:2])[0], codes[1:2]) and torch.equal(c.decode(codes[1:2]), d[1:2])
    # the bound is tight enough to fail: one token's codes all at the codec's largest code break it
    bad, (off, size) = codes.clone(), c.sections["codes"]
    bad[:, off : off + size // 15] = {"fp8": 0x7E, "int8": 0x7F, "int4": 0xFF}[name]
    assert not bool(((c.decode(bad) - h).abs() <= c.bound(h)).all())


def test_the_bits_per_element_at_smollm2s_shape():
    bits = {n: make(n, 256, 576).bits for n in CODECS}
    # codes, position 0, one scale per token, 8 kept channels and their indices
    assert (
        bits["fp8"]
        == bits["int8"]
        == pytest.approx((255 * 576 + 2 * 576 + 4 * 255 + 2 * 8 * 255 + 2 * 8) * 8 / (256 * 576))
    )
    assert 8 < bits["int8"] < 8.5 and 4 < bits["int4"] < 4.5
    with pytest.raises(ValueError, match="boundary.codec_keep"):
        make("int8", 16, 64, keep=64)
    with pytest.raises(ValueError, match="boundary.codec must be one of"):
        Codec("int2", 16, 64)


def synthetic_store(tmp_path, name, h, rows=4):
    """A store of boundaries ``h`` ``[n, t, hidden]`` (boundary 0 and 1 alike), written by the store's own writer."""
    model, _ = load(materialise("tiny-llama", outputs=tmp_path / "t"))
    shards = []
    for lo in range(0, len(h), rows):
        sd = tmp_path / "store" / f"train-{lo:08d}"
        sd.mkdir(parents=True)
        chunk = h[lo : lo + rows]
        write_shard(
            sd,
            model,
            np.zeros((len(chunk), h.shape[1]), np.int32),
            "train",
            lo,
            [0, 1],
            "float32",
            2,
            {},
            capture=lambda ids, chunk=chunk, k=[0]: _batches(chunk, ids, k),
            width=h.shape[2],
            codec={"name": name, "keep": 4},
        )
        shards.append(sd)
    join_shards(tmp_path / "store", shards, {"train": len(h), "val": 0}, {})
    return tmp_path / "store"


def _batches(chunk, ids, k):
    out = chunk[k[0] : k[0] + len(ids)]
    k[0] += len(ids)
    return {0: out, 1: out * 2}


@pytest.mark.parametrize("name", CODECS)
def test_a_channel_at_1e4_times_the_others_is_kept_and_the_rest_stay_within_bound(name, tmp_path):
    h = residual(n=6, massive=5)
    path = synthetic_store(tmp_path, name, h)
    c = make(name, 16, 64, keep=4)
    with BoundaryReader(path) as r:
        assert r.manifest["format_version"] == 7 and r.manifest["codec"]["name"] == name
        # the bytes a shard's open hashes are those outside the sequence data, as for format 6 (open-time cost
        # independent of the store's size); the feed sizes a batch by the encoded bytes
        assert [sh["files"]["b0"]["data"][1] for sh in r.manifest["shards"]] == [
            4 * c.sequence_bytes,
            2 * c.sequence_bytes,
        ]
        assert stored_batch_bytes(r, 2, 2) == 4 * c.sequence_bytes
        x = r.read("train", 0, np.arange(6))
        assert x.dtype == torch.uint8 and torch.equal(x, c.encode(h)[0])  # the reader moves the encoded bytes
        d = r.widen(x)
        stats = r.stats(0)
    err = (d - h).abs()
    assert bool((err <= c.bound(h)).all())
    massive = err[:, 1:, 5] / h[:, 1:, 5].abs()
    assert float(massive.max()) <= 2.0**-8  # kept in bfloat16
    rest = [i for i in range(64) if i != 5]
    assert rel_mse(d[:, 1:, rest], h[:, 1:, rest]) < REL_MSE[name]
    # the store's statistics are those of the decoded values (what online targets compute too)
    assert torch.allclose(stats[1], d[:, 1:].pow(2).mean((0, 1)).sqrt(), rtol=1e-5)


@pytest.mark.parametrize("name", CODECS)
def test_a_flipped_code_byte_and_a_flipped_scale_byte_are_both_damaged(name, tmp_path):
    h = residual(n=4)
    c = make(name, 16, 64, keep=4)
    for part in ("codes", "scale"):
        path = synthetic_store(tmp_path / part, name, h)
        man = json.loads((path / "manifest.json").read_text())
        sh = man["shards"][0]
        f = (path / sh["dir"]).resolve() / sh["files"]["b0"]["name"]
        offset = sh["files"]["b0"]["data"][0] + c.sequence_bytes + c.sections[part][0] + 1  # sequence 1's byte
        with open(f, "r+b") as fh:
            fh.seek(offset)
            byte = fh.read(1)[0]
            fh.seek(offset)
            fh.write(bytes([byte ^ 0x10]))
        problems = check_store(path, quarantine_damaged=False)  # zerograph verify's check
        assert len(problems) == 1 and "checksum failure" in problems[0][1]
        with BoundaryReader(path) as r, pytest.raises(BoundaryStoreError, match="sequence 1's bytes differ"):
            r.read("train", 0, [1])
        assert list(path.glob("train-*.damaged-*"))  # moved aside: the next run rebuilds it


def test_non_finite_scales_fail_the_build(tmp_path):
    h = residual(n=2)
    h[1, 3, 7] = float("inf")
    with pytest.raises(BoundaryStoreError, match="non-finite"):
        synthetic_store(tmp_path, "int8", h, rows=2)


@pytest.mark.parametrize("name", CODECS)
def test_cached_and_online_blocks_are_byte_identical_for_every_codec(name, tmp_path, run_graph):
    from tasks.blocks import TrainBlock
    from workflows import load_config
    from workflows.experiment import block_settings

    files = {}
    for targets in ("cached", "online"):
        cfg = load_config(
            "", tiny_cfg(**{"train.targets": targets, "boundary.codec": name, "train.max_steps": 3}), "tiny"
        )
        task = TrainBlock(
            teacher=cfg["teacher"],
            corpus=cfg["corpus"],
            boundary=cfg["boundary"],
            block=1,
            train=block_settings(cfg)[1],
            outputs=str(tmp_path),
        )
        ok, ran = run_graph(task)
        assert ok and ("TeacherBoundary" in [f for f, _ in ran]) == (targets == "cached")
        files[targets] = (task.out_dir / "block.safetensors").read_bytes()
    assert files["cached"] == files["online"]
    store = next(Path(tmp_path).glob("TeacherBoundary/*/manifest.json"))
    assert json.loads(store.read_text())["codec"]["name"] == name
    with h5py.File(next(Path(tmp_path).glob("BoundaryShard/*/b0.h5")), "r") as f:
        assert f["h"].dtype == np.uint8 and f["h"].ndim == 2


def test_the_codec_enters_the_hash_only_when_not_none():
    from tasks.cache import TeacherBoundary, cache_settings
    from workflows import load_config

    cfg = load_config("", tiny_cfg(), "tiny")
    b = dict(cfg["boundary"])
    assert "codec" not in cache_settings(b) and "codec_keep" not in cache_settings(b)
    old = {k: v for k, v in b.items() if k not in ("codec", "codec_keep")}
    kw = {"teacher": cfg["teacher"], "corpus": cfg["corpus"]}
    assert TeacherBoundary(boundary=b, **kw).uid == TeacherBoundary(boundary=old, **kw).uid
    assert (
        cache_settings({**b, "codec": "fp8"})["codec"] == "fp8"
        and cache_settings({**b, "codec": "fp8"})["codec_keep"] == 8
    )
    assert cache_settings({**b, "codec": "int4", "codec_keep": 2})["codec_keep"] == 2
    uids = {TeacherBoundary(boundary={**b, "codec": n}, **kw).uid for n in NAMES}
    assert len(uids) == 4


def test_a_bad_codec_setting_is_one_config_error():
    from workflows import load_config
    from zgcore.checks import ConfigError

    for bad, says in (("boundary.codec=int3", "boundary.codec must be one of none, fp8, int8, int4, got 'int3'"),
                      ("boundary.codec_keep=-1", "boundary.codec_keep must be a non-negative integer, got -1")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config("", tiny_cfg() + " " + bad, "tiny")
