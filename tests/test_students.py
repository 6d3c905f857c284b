"""Students shaped by measurement: keep="importance" (ShortGPT block influence) and narrower MLPs
initialised from the teacher's most active channels (Minitron), on tiny random teachers."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import tiny_cfg
from workflows import RunExperiment
from workflows.experiment import build_experiment, load_config
from zgcore.models.adapters import assemble, build_block, capture_boundaries
from zgcore.checks import ConfigError
from zgcore.models.channels import mlp_width, top_channels
from zgcore.models.students import measure
from zgcore.models.teacher import load, materialise


@pytest.fixture(scope="module", params=["llama", "phi3", "gpt2"])
def teacher(request, tmp_path_factory):
    return load(materialise(f"tiny-{request.param}", outputs=tmp_path_factory.mktemp(request.param)))[0]


def _ids(seed, n=3, t=16):
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


def test_block_influence_is_one_minus_cosine_of_layer_input_and_output(teacher):
    ids = _ids(0)
    m = measure(teacher, ids.numpy(), batch_size=2)
    bd = capture_boundaries(teacher, ids, [1, 2])
    want = 1 - torch.nn.functional.cosine_similarity(bd[1], bd[2], dim=-1).mean().item()
    assert m["influence"][1] == pytest.approx(want, rel=1e-5)
    assert len(m["channels"]) == 4 and all(len(c) == mlp_width(teacher.config) for c in m["channels"])


def test_narrow_block_equals_teacher_with_other_channels_silenced(teacher):
    ids = _ids(1)
    m = measure(teacher, ids.numpy())
    width = mlp_width(teacher.config) // 2
    block = build_block(teacher, [1], "teacher", 0, intermediate_size=width, channels=m["channels"])
    assert block.width == width
    keep = top_channels(m["channels"][1], width)
    silence = torch.ones(mlp_width(teacher.config))
    silence[keep] = 0
    layer = teacher.get_decoder().layers[1] if hasattr(teacher, "model") else teacher.transformer.h[1]
    down = layer.mlp.down_proj if hasattr(layer.mlp, "down_proj") else layer.mlp.c_proj
    hook = down.register_forward_pre_hook(lambda _m, a: (a[0] * (1 - silence),))
    try:
        bd = capture_boundaries(teacher, ids, [1, 2])
    finally:
        hook.remove()
    with torch.no_grad():
        assert torch.allclose(block(bd[1]), bd[2], atol=1e-5)
    # the kept channels are the most active ones
    mags = torch.tensor(m["channels"][1])
    assert mags[keep].min() >= mags[silence.bool()].max()


def test_blocks_of_different_widths_assemble_by_zero_padding(teacher):
    ids = _ids(2, n=1, t=10)
    m = measure(teacher, ids.numpy())
    full = mlp_width(teacher.config)
    narrow = [build_block(teacher, [0, 1], "teacher", 0, intermediate_size=full // 4, channels=m["channels"]),
              build_block(teacher, [2, 3], "teacher", 0, intermediate_size=full // 2, channels=m["channels"])]
    student = assemble(teacher, narrow)
    key = "n_inner" if teacher.config.model_type == "gpt2" else "intermediate_size"
    assert getattr(student.config, key) == full // 2
    bd = capture_boundaries(student, ids, [0, 2, 4])
    with torch.no_grad():
        assert torch.allclose(narrow[0](bd[0]), bd[2], atol=1e-5)  # the padded block computes the narrow one
        assert torch.allclose(narrow[1](bd[2]), bd[4], atol=1e-5)


def _report(ev):
    return json.loads((ev.out_dir / "report.json").read_text())


def test_importance_keeps_the_most_influential_layers_and_reports_them(tmp_path, run_graph):
    out = str(tmp_path)
    cfg = tiny_cfg(**{"train.keep": "importance", "train.importance_sequences": 4, "train.max_steps": 2})
    assert run_graph(RunExperiment(preset="", set=cfg, outputs=out))[0]
    ev = build_experiment(load_config(overrides=cfg, preset=""), out)
    imp = json.loads(next((tmp_path / "LayerImportance").glob("*/importance.json")).read_text())
    assert imp["sequences"] == 4 and len(imp["influence"]) == 4
    blocks = _report(ev)["blocks"]
    for b in blocks:
        part = imp["influence"][b["start"]:b["end"]]
        assert b["kept"] == [b["start"] + part.index(max(part))] and b["influence"] == part
    assert f"| {blocks[0]['kept']} |" in (ev.out_dir / "report.md").read_text()


def test_width_pruned_student_runs_assembles_loads_and_generates(tmp_path, run_graph):
    out = str(tmp_path)
    cfg = tiny_cfg(**{"train.n_layers": "null", "train.keep_fraction": 1, "train.intermediate_size": 32,
                      "blocks.1.intermediate_size": 48, "train.importance_sequences": 4, "train.max_steps": 2})
    assert run_graph(RunExperiment(preset="", set=cfg, outputs=out))[0]
    report = _report(build_experiment(load_config(overrides=cfg, preset=""), out))
    assert [b["intermediate_size"] for b in report["blocks"]] == [32, 48]
    model = AutoModelForCausalLM.from_pretrained(report["model_dir"])
    assert model.config.intermediate_size == 48 and model.model.layers[0].mlp.up_proj.weight.shape == (48, 32)
    assert model.generate(torch.tensor([[72, 105]]), max_new_tokens=4, do_sample=False).shape == (1, 6)


@pytest.mark.parametrize("over, want", [
    ({"train.keep": "importance", "train.n_layers": 3}, "block 0: n_layers=3 exceeds the partition's 2 teacher layers"),
    ({"train.intermediate_size": 65}, "block 0: intermediate_size=65 exceeds the MLP width of tiny-llama \\(64\\)"),
    ({"blocks.1.intermediate_size": 0}, "blocks.1.intermediate_size must be a positive integer or null, got 0"),
])
def test_bad_student_shapes_fail_at_graph_construction(over, want):
    with pytest.raises(ConfigError, match=want):
        load_config(overrides=tiny_cfg(**over), preset="")
