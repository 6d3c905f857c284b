"""Every supported family end to end on a tiny random config (no download): the whole graph runs;
keeping every layer, the untrained and (weights not moved by training) assembled students score the
teacher's held-out CE to 1e-5 nats; the assembled folder loads with AutoModelForCausalLM and generates."""
import json

import pytest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import tiny_cfg
from workflows import RunExperiment
from workflows.experiment import build_experiment, load_config
from zgcore.models.teacher import TINY_FAMILIES, tiny_config

# Every layer kept: each block starts as its teacher partition, so the regression loss is ~0 and the
# gradients vanish; lr 1e-30 keeps float noise from moving any weight either. Training still runs
# the whole loop (optimizer, checkpoints, saved weights), and the test checks that no weight moved.
IDENTITY = {"train.n_layers": "null", "train.keep_fraction": 1, "train.lr": 1e-30, "train.max_steps": 1,
            "train.warmup_steps": 0, "corpus.max_tokens": 1024, "eval.context_sequences": 0}


@pytest.mark.parametrize("spec", list(TINY_FAMILIES))
def test_family_graph_identity_load_and_generate(spec, tmp_path, run_graph):
    out = str(tmp_path)
    cfg = tiny_cfg(spec, **IDENTITY)
    ok, _ = run_graph(RunExperiment(preset="", set=cfg, outputs=out))
    assert ok
    ev = build_experiment(load_config(overrides=cfg, preset=""), out)
    report = json.loads((ev.out_dir / "report.json").read_text())
    assert report["layers"] == {"teacher": 4, "untrained": 4, "student": 4}
    ce = report["cross_entropy"]
    assert abs(ce["untrained"] - ce["teacher"]) < 1e-5
    assert abs(ce["student"] - ce["teacher"]) < 1e-5
    for t in ev.requires()["blocks"]:  # training ran but moved no weight by more than 1e-20
        trained, init = load_file(str(t.out_dir / "block.safetensors")), load_file(str(t.out_dir / "init.safetensors"))
        assert trained.keys() == init.keys()
        assert max((trained[k] - init[k]).abs().max().item() for k in init) < 1e-20
    model = AutoModelForCausalLM.from_pretrained(report["model_dir"])
    assert model.config.model_type == tiny_config(TINY_FAMILIES[spec]).model_type
    tok = AutoTokenizer.from_pretrained(report["model_dir"])
    prompt = tok("The", return_tensors="pt").input_ids
    gen = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert gen.shape == (1, prompt.shape[1] + 5)
