import h5py
import numpy as np
import pytest
import torch

from zgcore.boundary_store import BoundaryReader, BoundaryStoreError, write_store
from zgcore.adapters import capture_boundaries
from zgcore.teacher import load, materialise


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("store")
    model, _ = load(materialise("tiny-llama", outputs=d))
    rng = np.random.default_rng(0)
    tokens = {"train": rng.integers(0, 256, (10, 16)).astype(np.int32), "val": rng.integers(0, 256, (3, 16)).astype(np.int32)}
    path = d / "boundaries.h5"
    write_store(path, model, tokens, [0, 2, 4], "float32", 4, {"teacher_fingerprint": "abc"}, log=lambda m: None)
    return path, model, tokens


def test_store_holds_exact_teacher_boundaries(store):
    path, model, tokens = store
    ids = torch.from_numpy(tokens["train"][[7, 2]].astype(np.int64))
    ref = capture_boundaries(model, ids, [0, 2, 4])
    with BoundaryReader(path, expect={"teacher_fingerprint": "abc", "boundaries": [0, 2, 4]}) as r:
        assert r.n("train") == 10 and r.n("val") == 3
        for b in (0, 2, 4):
            assert torch.equal(r.read("train", b, [7, 2]), ref[b])  # any order, exact bytes
        st = r.stats(4)
        assert st.shape == (2, model.config.hidden_size) and (st > 0).all()
        batches = list(r.batches("train", 0, 2, np.arange(10), 4))
        assert [k for k, _, _ in batches] == [0, 1, 2] and batches[-1][1].shape[0] == 2


def test_manifest_mismatch_and_truncation_are_detected(store, tmp_path):
    path, _, _ = store
    with pytest.raises(BoundaryStoreError, match="teacher_fingerprint"):
        BoundaryReader(path, expect={"teacher_fingerprint": "other"})
    bad = tmp_path / "truncated.h5"
    bad.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(BoundaryStoreError):
        BoundaryReader(bad)
    short = tmp_path / "short.h5"
    short.write_bytes(path.read_bytes())
    with h5py.File(short, "a") as f:
        del f["train/b2"]
        f.create_dataset("train/b2", data=np.zeros((5, 16, 32), np.float32))
    with pytest.raises(BoundaryStoreError, match="train/b2"):
        BoundaryReader(short)
