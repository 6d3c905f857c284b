"""Device handling: the scheduling process never initialises CUDA; the GPU path runs where a GPU is."""
import json

import pytest
import torch

from tests.conftest import tiny_cfg
from workflows import RunExperiment
from workflows.experiment import build_experiment, load_config


def test_building_the_graph_does_not_touch_cuda(tmp_path):
    cfg = load_config(overrides=tiny_cfg() + " device=cuda", preset="")
    root = build_experiment(cfg, str(tmp_path))
    assert root.device == "cuda" and all(t.device == "cuda" for t in root.block_tasks())
    assert not torch.cuda.is_initialized()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_tiny_experiment_on_cuda(tmp_path, run_graph):
    ok, _ = run_graph(RunExperiment(preset="", set=tiny_cfg() + " device=cuda", outputs=str(tmp_path)))
    assert ok
    root = build_experiment(load_config(overrides=tiny_cfg() + " device=cuda", preset=""), str(tmp_path))
    report = json.loads((root.out_dir / "report.json").read_text())
    assert report["cross_entropy"]["student"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_on_a_cpu_machine_fails_with_a_clear_message(tmp_path, run_graph):
    ok, ran = run_graph(RunExperiment(preset="", set=tiny_cfg() + " device=cuda", outputs=str(tmp_path)))
    assert not ok


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_fla_kernel_and_the_pytorch_form_agree_on_cuda():
    from zgcore.models.hf_linear_attention import fla_linear_attn

    if fla_linear_attn() is None:
        pytest.skip("flash-linear-attention is not installed: scripts/device_check.sh installs fla-core")
    from scripts.fla_check import main

    assert main(["--lengths", "100", "256", "--batch", "1"]) == 0
