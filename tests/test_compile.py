"""``train.compile``: a block's training step through torch.compile is bitwise the same from run to
run and after an interruption, and the setting is hashed only when on (eager blocks keep their
hashes)."""
import numpy as np
import pytest
import torch

from zgcore.config.defaults import DEFAULTS
from zgcore.config.experiment import ConfigError
from zgcore.data.boundary_store import BoundaryReader, build_store
from zgcore.models.adapters import build_block
from zgcore.models.teacher import load, materialise
from zgcore.config.experiment import effective_train
from zgcore.training.blocks import BlockTraining, train_block
from workflows.experiment import load_config


class Stop(Exception):
    pass


def test_compiled_training_is_reproducible_resumes_to_the_same_bytes_and_is_hashed_only_when_on(tmp_path, monkeypatch):
    compiled = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda module, **kw: compiled.append(module) or real(module, **kw))
    model, _ = load(materialise("tiny-llama", outputs=tmp_path))
    rng = np.random.default_rng(0)
    tokens = {"train": rng.integers(0, 256, (12, 16)).astype(np.int32), "val": rng.integers(0, 256, (2, 16)).astype(np.int32)}
    build_store(tmp_path / "store", model, tokens, [0, 1], "float32", 2, {}, shard_sequences=4, log=lambda m: None)
    t = {**DEFAULTS["train"], "max_steps": 6, "checkpoint_every": 2, "batch_size": 3, "tensorboard": False,
         "prefetch": 0, "compile": True, "lrs": []}

    def trained(work, stop_at=None, **over):
        block = build_block(model, [0], "teacher", 7)

        def stop(info):
            if info.step == stop_at:
                raise Stop
        with BoundaryReader(tmp_path / "store") as r:
            try:
                train_block(block, r, 0, 1, BlockTraining({**t, **over}, 7, work, run_hash="h", callbacks=[stop]))
            except Stop:
                return None
        return b"".join(v.numpy().tobytes() for _, v in sorted(block.layer_state_dict().items()))

    once = trained(tmp_path / "a")
    assert len(compiled) == 1  # the block's step went through torch.compile
    assert trained(tmp_path / "b") == once  # a second compiled run, same bytes
    assert trained(tmp_path / "c", stop_at=3) is None  # interrupted after the checkpoint at step 2
    assert trained(tmp_path / "c") == once  # resumed from step 2, compiled again: the same bytes
    eager = trained(tmp_path / "d", compile=False)
    assert eager is not None and len(eager) == len(once) and len(compiled) == 4  # eager: not compiled

    assert "compile" not in effective_train({**t, "compile": False}) and effective_train(t)["compile"] is True
    assert load_config(overrides="train.compile=true", preset="tiny")["train"]["compile"] is True
    with pytest.raises(ConfigError, match="train.compile must be true or false"):
        load_config(overrides="train.compile=3", preset="tiny")
