"""Local auxiliary terms on ZeroGraph blocks: next-token CE and MTP through the teacher's
frozen head, their hashing (weight 0 = no change) and their validation."""
from __future__ import annotations

import copy
import csv
import math

import numpy as np
import pytest
import torch

from tests.conftest import tiny_cfg
from zgcore.data.order import data_order
from zgcore.config.experiment import effective_train
from zgcore.training import blocks as ztrain
from zgcore.models.adapters import StudentBlock, head_logits, head_only
from zgcore.data.boundary_store import OnlineBoundaries
from zgcore.checks import ConfigError
from zgcore.training.objectives import aux_losses, offset_ce
from zgcore.models.teacher import tiny_config


def test_ce_and_mtp_on_hand_computable_logits():
    # vocab 3; position 0 logits (ln 2, 0, 0) -> p = (1/2, 1/4, 1/4); position 1 uniform (1/3 each)
    logits = torch.tensor([[[math.log(2), 0.0, 0.0], [0.0, 0.0, 0.0], [5.0, -5.0, 1.0]]])
    ids = torch.tensor([[0, 0, 2]])
    # k=1: position 0 predicts id 0 (-ln 1/2), position 1 predicts id 2 (-ln 1/3)
    assert offset_ce(logits, ids, 1).item() == pytest.approx((math.log(2) + math.log(3)) / 2, abs=1e-6)
    # k=2: position 0 predicts id 2 (-ln 1/4)
    assert offset_ce(logits, ids, 2).item() == pytest.approx(math.log(4), abs=1e-6)
    out = aux_losses(logits, ids, {"ce": 0.1, "mtp": 0.2}, mtp_n=2)
    assert out["ce"].item() == pytest.approx((math.log(2) + math.log(3)) / 2, abs=1e-6)
    assert out["mtp"].item() == pytest.approx(((math.log(2) + math.log(3)) / 2 + math.log(4)) / 2, abs=1e-6)
    # offsets beyond the sequence are skipped: mtp_n=9 on 3 tokens uses k = 1, 2 only
    assert aux_losses(logits, ids, {"mtp": 1.0}, mtp_n=9)["mtp"].item() == pytest.approx(out["mtp"].item(), abs=1e-6)
    assert set(aux_losses(logits, ids, {"ce": 1.0}, 2)) == {"ce"}


def test_zero_weights_are_not_hashed_and_positive_ones_are():
    base = {"objective": "clean", "noise": 0.1, "max_steps": 5, "epochs": 1, "n_layers": 1, "keep_fraction": 0.8,
            "checkpoint_every": 2, "lr": 1e-3}
    zero = {**base, "ce_weight": 0.0, "mtp_weight": 0, "mtp_n": 4}
    assert effective_train(zero) == effective_train(base)
    on = effective_train({**zero, "ce_weight": 0.1})
    assert on["ce_weight"] == 0.1 and "mtp_n" not in on and "mtp_weight" not in on
    on = effective_train({**zero, "mtp_weight": 0.3})
    assert on["mtp_weight"] == 0.3 and on["mtp_n"] == 4 and "ce_weight" not in on


def test_default_experiment_hashes_do_not_move():
    """A TrainBlock without the new keys (as before those keys existed) and one with their zero defaults share one hash."""
    from workflows import load_config
    from workflows.experiment import block_settings
    from tasks.blocks import TrainBlock

    cfg = load_config("", tiny_cfg(), "tiny")
    t = block_settings(cfg)[0]
    old = {k: v for k, v in t.items() if k not in ("ce_weight", "mtp_weight", "mtp_n")}
    kw = dict(teacher=cfg["teacher"], corpus=cfg["corpus"], boundary=cfg["boundary"], block=0)
    assert TrainBlock(train=t, **kw).uid == TrainBlock(train=old, **kw).uid
    assert TrainBlock(train={**t, "ce_weight": 0.1}, **kw).uid != TrainBlock(train=old, **kw).uid


@pytest.mark.parametrize("over,what", [({"train.ce_weight": -0.1}, "ce_weight"), ({"train.mtp_weight": -1}, "mtp_weight"),
                                       ({"train.mtp_n": 0}, "mtp_n"), ({"blocks.1.ce_weight": "x"}, "ce_weight")])
def test_bad_aux_settings_fail_at_graph_construction(over, what):
    from workflows import RunExperiment

    with pytest.raises(ConfigError, match=what):
        RunExperiment(preset="tiny", set=tiny_cfg(**over))


def test_train_block_adds_the_terms_on_the_right_tokens():
    """With an 'identity' head (the first V channels of the block's output are its logits), the first
    logged CE and MTP equal the terms computed by hand on the first batch's sequences in data order."""
    torch.manual_seed(0)
    teacher_cfg = tiny_config("llama", n_layers=2, hidden=32, vocab=260)
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_config(teacher_cfg).eval().requires_grad_(False)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 8, size=(6, 16)).astype(np.int64)
    V = 8
    head = lambda h: h[..., :V]  # noqa: E731
    block = StudentBlock(teacher_cfg, [1])
    before = copy.deepcopy(block)
    t = {"objective": "clean", "loss_norm": "channel", "batch_size": 2, "max_steps": 2, "epochs": 1, "lr": 1e-3,
         "warmup_steps": 0, "weight_decay": 0.0, "grad_clip": 1.0, "ce_weight": 0.5, "mtp_weight": 0.25, "mtp_n": 3}
    with OnlineBoundaries(teacher, tokens, [1, 2], "float32", 4) as src:
        run = ztrain.BlockTraining(t, seed=7, work=None, run_hash="x", head=head, tokens=tokens)
        m = ztrain.train_block(block, src, 1, 2, run)
        idx = data_order(6, 7, 0)[:2]
        x, y = src.read("train", 1, idx), src.read("train", 2, idx)
        with torch.no_grad():
            logits = head(before(x))
            reg = ztrain.regression_loss(before(x), y, "channel", src.stats(2)).item()
    ids = torch.as_tensor(tokens[idx])
    ce = offset_ce(logits, ids, 1).item()
    mtp = np.mean([offset_ce(logits, ids, k).item() for k in (1, 2, 3)])
    assert set(m) >= {"final_ce", "final_mtp", "final_regression"}
    # TrainLoop without a work folder keeps the log in memory only; the first row is step 1
    assert m["first_loss"] == pytest.approx(reg + 0.5 * ce + 0.25 * mtp, rel=1e-5)
    with pytest.raises(ValueError, match="ce_weight"):
        run = ztrain.BlockTraining(t, seed=7, work=None, run_hash="x")
        ztrain.train_block(StudentBlock(teacher_cfg, [1]), src, 1, 2, run)


def test_head_only_keeps_the_head_and_drops_the_layers():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama", n_layers=2)).eval()
    h = torch.randn(1, 4, 32)
    want = head_logits(teacher, h)
    m = head_only(teacher)
    assert len(m.model.layers) == 0 and not any(p.requires_grad for p in m.parameters())
    assert torch.equal(head_logits(m, h), want)


def test_trainblock_with_ce_term_runs_and_logs_the_terms(tmp_path, run_graph):
    from workflows import load_config
    from workflows.experiment import block_settings
    from tasks.blocks import TrainBlock

    cfg = load_config("", tiny_cfg(**{"train.ce_weight": 0.1, "train.mtp_weight": 0.1, "train.mtp_n": 2,
                                      "train.max_steps": 3}), "tiny")
    task = TrainBlock(teacher=cfg["teacher"], corpus=cfg["corpus"], boundary=cfg["boundary"], block=0,
                      train=block_settings(cfg)[0], outputs=str(tmp_path))
    ok, _ = run_graph(task)
    assert ok
    rows = list(csv.reader(open(task.out_dir / "loss_log.csv")))
    assert rows[0] == ["step", "loss", "regression", "ce", "mtp", "lr"] and len(rows) == 4
    for r in rows[1:]:
        loss, reg, ce, mtp = map(float, r[1:5])
        assert loss == pytest.approx(reg + 0.1 * ce + 0.1 * mtp, rel=1e-5)
        assert 0 < ce < 10 and 0 < mtp < 10
