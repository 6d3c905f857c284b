"""The plan (``zerograph plan``, zgcore/evaluation/plan*.py, workflows/plan.py) and the pre-flight
that guards a run with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.scale_configs import CONFIGS, write_config
from zgcore.evaluation import plan as zplan
from zgcore.evaluation import plan_costs, plan_training
from zgcore.evaluation.accelerators import ACCELERATORS, device
from zgcore.evaluation.plan_shape import read_config, shape_of

ROOT = Path(__file__).resolve().parents[1]
LUIGI = str(Path(sys.executable).parent / "luigi")


def cli(*args: str):
    from workflows.cli import app

    return CliRunner().invoke(app, list(args))


def test_the_shapes_of_real_configs_count_their_published_parameters():
    # the parameter counts each model card publishes (embeddings and an untied head included)
    published = {
        "Llama-3.2-1B": 1.2358e9,
        "Llama-3.1-8B": 8.0303e9,
        "Llama-3.1-70B": 70.5537e9,
        "Qwen2.5-1.5B": 1.5437e9,
        "Qwen2.5-3B": 3.0859e9,
    }
    for name, n in published.items():
        assert shape_of(CONFIGS[name]).total() == pytest.approx(n, rel=1e-4), name


def test_the_shape_of_a_tiny_teacher_is_its_built_model_s():
    import transformers

    from zgcore.evaluation.flops import model_parameters

    for spec in ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma2", "tiny-gpt2", "tiny-olmo2"):
        cfg = read_config(spec)
        from zgcore.models.teacher import TINY_FAMILIES, tiny_config

        model = transformers.AutoModelForCausalLM.from_config(tiny_config(TINY_FAMILIES[spec]))
        s = shape_of(cfg)
        assert s.flops_par() == model_parameters(model), spec
        assert s.total() == sum(p.numel() for p in model.parameters()), spec


def test_a_70b_plan_from_a_folder_holding_only_config_json(tmp_path):
    folder = write_config("Llama-3.1-70B", tmp_path / "l70")
    assert [p.name for p in folder.iterdir()] == ["config.json"]
    out = tmp_path / "o"
    r = cli(
        "plan",
        "--tokens",
        "40000000",
        "--device",
        "h100",
        "--devices",
        "8",
        "--json",
        "--set",
        f"teacher={folder} device=cuda",
        "--outputs",
        str(out),
    )
    assert r.exit_code == 0, r.output
    rec = json.loads(r.output)
    fams = {t["family"] for t in rec["tasks"]}
    assert {"BoundaryShard", "TeacherBoundary", "TrainBlock", "Assemble", "ScoreTeacher", "Evaluate"} <= fams
    for t in rec["tasks"]:
        assert {"family", "host_bytes", "device_bytes", "bytes_written", "flops", "seconds"} <= set(t)
    tot = rec["totals"]
    rows = 40_000_000 // 256
    # 4 boundaries (K = 3) of every sequence, float32, 8192 wide: the store is that and a few KiB a file
    assert tot["store_bytes"] == pytest.approx(rows * 256 * 8192 * 4 * 4, rel=2e-3)
    blocks = [t for t in rec["tasks"] if t["family"] == "TrainBlock"]
    assert len(blocks) == 3 and all(t["device"]["optimizer"] > 0 and t["host"]["optimizer"] == 0 for t in blocks)
    assert tot["peak_device_bytes"] > ACCELERATORS["h100"].memory  # float32 70B weights: no single H100 holds them
    assert tot["device_hours"] > tot["wall_seconds"] / 3600 > tot["device_hours"] / 8 * 0.99
    assert not list(out.glob("*/*")), "planning built something"
    # without the plan's config-only reading the same folder is refused (no weights, no tokenizer)
    r = cli("status", "--set", f"teacher={folder} device=cuda", "--outputs", str(tmp_path / "other"))
    assert r.exit_code == 2 and "weights" in r.output


def test_the_plan_prints_a_table_and_names_an_unknown_device(tmp_path):
    r = cli("plan", "--preset", "tiny", "--outputs", str(tmp_path), "--device", "a100")
    assert r.exit_code == 0, r.output
    assert "TrainBlock block0" in r.output and "store:" in r.output and "device-hours" in r.output
    r = cli("plan", "--preset", "tiny", "--outputs", str(tmp_path), "--device", "tpu9")
    assert r.exit_code == 2 and "unknown device 'tpu9'" in r.output


def test_every_family_of_every_registered_workflow_has_a_cost_model(tmp_path):
    import workflows
    from workflows import registry
    from workflows.plan import graph_tasks

    seen = set()
    for wf in registry.all_workflows():
        root = getattr(workflows, wf.name)(preset=wf.tiny, outputs=str(tmp_path))
        tasks, _, _ = graph_tasks(
            list(root.requires()) if isinstance(root.requires(), list) else [root.requires()], None
        )
        seen |= {t.get_task_family() for t in tasks}
    missing = sorted(seen - set(zplan.FAMILIES))
    assert not missing, f"task families without a cost model in zgcore/evaluation/plan.py FAMILIES: {missing}"
    assert {"BoundaryShard", "TrainBlock", "PretrainLocal", "DistillE2E", "ScoreCandidate"} <= seen
    with pytest.raises(KeyError, match="'NewTask' has no cost model"):  # a family added tomorrow without one
        zplan.task_cost("NewTask", {}, plan_costs.Context(shape_of(CONFIGS["Qwen2.5-1.5B"]), 10, 1))


def test_the_step_count_is_the_training_loop_s():
    from zgcore.training.blocks import total_steps

    assert plan_training.total_steps is total_steps  # one count, not a copy held equal
    for n, t, steps in [
        (100, {"max_steps": 0, "batch_size": 4, "epochs": 1.5}, 38),
        (7, {"max_steps": 0, "batch_size": 4, "epochs": 1}, 2),
        (1000, {"max_steps": 33, "batch_size": 8, "epochs": 2}, 33),
    ]:
        assert total_steps(n, t) == steps


def test_a_codec_plugs_into_the_bytes_per_element():
    assert plan_costs.element_bytes({"dtype": "bfloat16"}) == 2
    plan_costs.CODECS["half_again"] = lambda dtype: plan_costs.DTYPE_BYTES[dtype] / 2
    try:
        assert plan_costs.element_bytes({"dtype": "float32", "codec": "half_again"}) == 2
        one = plan_costs.shard_file_bytes(10, 8, 16, {"dtype": "float32", "codec": "none"}, 0)
        half = plan_costs.shard_file_bytes(10, 8, 16, {"dtype": "float32", "codec": "half_again"}, 0)
        assert one - half == 10 * 8 * 16 * 2
    finally:
        del plan_costs.CODECS["half_again"]
    with pytest.raises(KeyError, match="'zstd9' has no bytes-per-element"):
        plan_costs.element_bytes({"dtype": "float32", "codec": "zstd9"})


def test_the_wall_time_runs_independent_tasks_side_by_side():
    def task(i, deps=(), secs=10.0, dev=True):
        return zplan.TaskPlan(f"t{i}", "F", f"t{i}", "train", {}, {}, 0, 0, 0, secs, dev, False, deps)

    shards = [task(i) for i in range(4)]
    join = task(9, deps=[t.id for t in shards], secs=1.0, dev=False)
    assert zplan.wall_seconds(shards + [join], 1) == 41.0
    assert zplan.wall_seconds(shards + [join], 4) == 11.0
    assert zplan.wall_seconds(shards + [join], 8) == 11.0
    assert zplan.totals(shards + [join], 4)["device_hours"] == pytest.approx(40 / 3600)


def test_a_named_device_states_its_source_and_this_machine_is_probed():
    h = device("h100")
    assert h.peak == 989e12 and h.memory == 80e9 and "nvidia.com" in h.source
    cpu = device("cpu", probe=lambda d: {"peak_flops_per_second": 1e11, "dtype": "float32", "threads": 2, "n": 512})
    assert cpu.peak == 1e11 and not cpu.accelerator and cpu.mfu["train"] == 0.67
    assert device("h200", mfu=0.5).mfu == {"train": 0.5, "forward": 0.5}


def test_the_planned_store_of_a_built_experiment_is_its_bytes_on_disk(smoke_run):
    out = smoke_run("tiny")
    r = cli("plan", "--preset", "tiny", "--outputs", str(out), "--json")
    assert r.exit_code == 0, r.output
    rec = json.loads(r.output)
    on_disk = sum(f.stat().st_size for f in (out / "BoundaryShard").rglob("*.h5"))
    planned = sum(t["bytes_written"] for t in rec["tasks"] if t["family"] == "BoundaryShard")
    assert planned == pytest.approx(on_disk, rel=0.02)
    whole = sum(
        f.stat().st_size for d in ("BoundaryShard", "TeacherBoundary") for f in (out / d).rglob("*") if f.is_file()
    )
    assert rec["totals"]["store_bytes"] == pytest.approx(whole, rel=0.02)
    assert all(t["done"] for t in rec["tasks"]) and rec["totals"]["bytes_written"] == 0


def _luigi(out: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            LUIGI,
            "--module",
            "workflows",
            "RunExperiment",
            "--local-scheduler",
            "--preset",
            "tiny",
            "--outputs",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )


def test_the_pre_flight_stops_a_run_whose_store_cannot_fit_its_disk(tmp_path):
    out = tmp_path / "o"
    r = _luigi(out, ZG_FREE_DISK_BYTES="100000")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: pre-flight: the tasks still to run write "), lines
    assert str(out) in lines[0] and "97.7 KiB free" in lines[0] and "boundary.dtype=bfloat16" in lines[0]
    assert not out.exists() or not any(out.iterdir()), "a task ran before the pre-flight"  # the writable probe may make it


def test_the_pre_flight_stops_a_task_that_cannot_fit_a_memory_limit(tmp_path, monkeypatch):
    import workflows
    from workflows import plan as wplan

    big = "corpus.seq_len=128 corpus.max_tokens=65536 train.batch_size=64 train.n_layers=2 boundary.num_blocks=1"
    root = workflows.RunExperiment(preset="tiny", set=big, outputs=str(tmp_path / "o"))
    monkeypatch.setenv(wplan.FREE_DISK_ENV, str(10**12))
    monkeypatch.setenv(wplan.MEMORY_LIMIT_ENV, str(10**12))
    assert wplan.preflight(root) is None
    p = wplan.make_plan([root.requires()], None, wplan._nominal_device(), 1)
    largest = max(p["tasks"], key=lambda t: t.host_bytes)
    assert largest.family == "TrainBlock" and largest.host["activations"] > largest.host["weights"]
    monkeypatch.setenv(wplan.MEMORY_LIMIT_ENV, str(largest.host_bytes - 1))
    msg = wplan.preflight(root)
    assert msg == (
        f"pre-flight: task {largest.name} needs {zplan.human(largest.host_bytes)} of host memory, "
        f"{zplan.human(largest.host_bytes - 1)} is free: try a smaller train.batch_size (heal.batch_size "
        "for healing)"
    )
    assert not (tmp_path / "o").exists()
