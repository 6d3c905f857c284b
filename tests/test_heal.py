"""Healing: end-to-end logit KD of the assembled student, as a setting of the experiment."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tests.conftest import tiny_cfg
from zgcore.training import distill as zdistill
from zgcore.training.memory import PeakRSS
from zgcore.checks import ConfigError


def test_kd_loss_by_hand():
    # two positions, vocab 2; teacher p = (1/2, 1/2) and (e/(1+e), 1/(1+e)); student uniform
    t = torch.tensor([[[0.0, 0.0], [1.0, 0.0]]])
    s = torch.zeros(1, 2, 2)
    p = math.e / (1 + math.e)
    kl1 = p * math.log(p / 0.5) + (1 - p) * math.log((1 - p) / 0.5)
    assert zdistill.kd_loss(s, t, 1.0).item() == pytest.approx(kl1 / 2, abs=1e-6)
    # at T = 2 the teacher's logits halve: p2 = e^.5/(1+e^.5), times T^2 = 4
    p2 = math.exp(0.5) / (1 + math.exp(0.5))
    kl2 = p2 * math.log(p2 / 0.5) + (1 - p2) * math.log((1 - p2) / 0.5)
    assert zdistill.kd_loss(s, t, 2.0).item() == pytest.approx(4 * kl2 / 2, abs=1e-6)
    assert zdistill.kd_loss(t, t, 3.0).item() == pytest.approx(0.0, abs=1e-7)


def test_e2e_steps_match_layer_token_passes():
    # 2 blocks x 10 steps x batch 4 x 2 layers = 160 layer-sequence passes; e2e: batch 4 x 4 layers = 16 per step
    assert zdistill.e2e_steps([(10, 4, 2), (10, 4, 2)], 4, 4) == 10
    assert zdistill.e2e_steps([(10, 4, 2), (5, 4, 1)], 3, 2) == 17  # (80 + 20) / 6 = 16.67 -> 17


@pytest.mark.parametrize("over,what", [({"heal.steps": -1}, "heal.steps"), ({"heal.temperature": 0}, "heal.temperature"),
                                       ({"heal.temperature": -1.5}, "heal.temperature"), ({"heal.lr": 0}, "heal.lr"),
                                       ({"heal.steps": 2, "seeds": "[0,1]"}, "single-seed")])
def test_bad_heal_settings_fail_at_graph_construction(over, what):
    from workflows import RunExperiment

    with pytest.raises(ConfigError, match=what):
        RunExperiment(preset="tiny", set=tiny_cfg(**over))


def test_heal_off_keeps_the_graph_and_on_evaluates_the_healed_student(tmp_path, run_graph):
    from tasks.heal import Heal
    from tasks.assemble import Assemble
    from workflows import build_experiment, load_config

    off = build_experiment(load_config("", tiny_cfg(), "tiny"), str(tmp_path))
    assert isinstance(off.requires()["assemble"], Assemble)
    cfg = load_config("", tiny_cfg(**{"heal.steps": 3, "heal.lr": 1e-3, "heal.batch_size": 2, "heal.checkpoint_every": 1}),
                      "tiny")
    on = build_experiment(cfg, str(tmp_path))
    assert on.requires()["assemble"].uid != off.requires()["assemble"].uid
    assert on.uid != off.uid  # the healed report is a new result; the unhealed one keeps its name
    heal = on.requires()["assemble"]
    assert isinstance(heal, Heal) and heal.requires()["assemble"].uid == off.requires()["assemble"].uid
    ok, ran = run_graph(on)
    assert ok and ("Heal", "healed-3") in ran
    m = json.loads((heal.out_dir / "metrics.json").read_text())
    assert m["steps"] == 3 and m["final_kd"] >= 0 and m["peak_rss_mib"] > 0 and m["tokens_seen"] == 3 * 2 * 32
    rep = json.loads((on.out_dir / "report.json").read_text())
    assert rep["heal_steps"] == 3 and rep["model_dir"] == str(heal.out_dir / "model")
    # healing moved the decoder layers and nothing else
    from safetensors.torch import load_file
    a = load_file(str(heal.requires()["assemble"].out_dir / "model" / "model.safetensors"))
    b = load_file(str(heal.out_dir / "model" / "model.safetensors"))
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert changed and all(".layers." in k for k in changed)
    # the first logged KD equals the KD of the assembled student on the first batch (by hand)
    from transformers import AutoModelForCausalLM
    from zgcore.data import corpus
    from zgcore.data.order import data_order
    rows = [line.split(",") for line in (heal.out_dir / "loss_log.csv").read_text().splitlines()]
    assert rows[0] == ["step", "loss", "kd", "lr"] and len(rows) == 4
    toks = corpus.read_tokens(heal.corpus_task().out_dir / "tokens.h5", "train")
    ids = torch.as_tensor(toks[data_order(len(toks), 0, 0)[:2]])
    student = AutoModelForCausalLM.from_pretrained(heal.requires()["assemble"].out_dir / "model", dtype=torch.float32)
    _, (teacher, _) = heal.load_teacher()
    with torch.no_grad():
        want = zdistill.kd_loss(student(input_ids=ids).logits, teacher(input_ids=ids).logits, 1.0).item()
    assert float(rows[1][2]) == pytest.approx(want, rel=1e-4)


def test_peak_rss_is_per_block():
    with PeakRSS() as small:
        pass
    with PeakRSS() as big:
        a = np.ones(20_000_000)  # 153 MiB
        a[::512] = 2.0
        del a
    if big.exact:
        assert big.mib - small.mib > 100
    assert big.mib > 0
