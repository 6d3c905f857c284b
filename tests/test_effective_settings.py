"""Only effective settings are hashed: for Heal and DistillE2E, every setting
their hash covers changes what they write. Each test varies every hashed key once (and checks
that the keys varied are exactly the keys hashed, so a new hashed key must join the test)."""
from __future__ import annotations

import json

import luigi
import pytest

from workflows import build_experiment, load_config
from workflows.distill import build_distill_study

# one changed value per hashed key, for the distill_tiny preset (2 blocks of 1 kept layer, 6 steps each)
SECTION_VARIANTS = {"steps": 4, "lr": 2e-3, "batch_size": 3, "temperature": 2.0, "hidden_weight": 1.0,
                    "warmup_steps": 2, "weight_decay": 0.5, "grad_clip": 1e-6, "seed": 1}


def _weights(task) -> bytes:
    return (task.out_dir / "model" / "model.safetensors").read_bytes()


def _build(make, over: str, tmp_path, run_graph):
    luigi.task_register.Register.clear_instance_cache()
    task = make(load_config("", over, "distill_tiny"), str(tmp_path))
    ok, _ = run_graph(task)
    assert ok, over
    return task


def test_every_hashed_heal_setting_changes_the_healed_student(tmp_path, run_graph):
    def heal(cfg, out):
        return build_experiment(cfg, out).requires()["assemble"]

    base = _build(heal, "", tmp_path, run_graph)
    assert set(base.own_config()["heal"]) == set(SECTION_VARIANTS)  # the keys varied are the keys hashed
    assert "blocks" not in base.requires()  # hidden_weight = 0: no boundary needed
    ref = _weights(base)
    for key, value in SECTION_VARIANTS.items():
        t = _build(heal, f"heal.{key}={value}", tmp_path, run_graph)
        assert t.out_dir != base.out_dir and _weights(t) != ref, f"heal.{key} is hashed but changed nothing"
    hidden = _build(heal, "heal.hidden_weight=1.0", tmp_path, run_graph)
    m = json.loads((hidden.out_dir / "metrics.json").read_text())
    assert m["pairs"] == [[1, 2]] and m["final_hidden"] > 0  # student layer 1 matches teacher boundary 2


def test_every_hashed_e2e_setting_changes_the_e2e_student(tmp_path, run_graph):
    def e2e(cfg, out):
        return build_distill_study(cfg, out).requires()["e2e_model"]

    base = _build(e2e, "", tmp_path, run_graph)
    own = base.own_config()
    assert set(own["distill"]) == set(SECTION_VARIANTS)
    block_variants = {"keep": "last", "init": "random", "n_layers": 2, "batch_size": 2, "max_steps": 8}
    assert set(own["blocks"][0]) == set(block_variants) and own["boundary"] == {"num_blocks": 2}
    ref = _weights(base)
    overs = [f"distill.{k}={v}" for k, v in SECTION_VARIANTS.items()]
    overs += [f"train.{k}={v}" for k, v in block_variants.items()] + ["boundary.num_blocks=4"]
    for over in overs:
        t = _build(e2e, over, tmp_path, run_graph)
        assert t.out_dir != base.out_dir and _weights(t) != ref, f"{over}: hashed but changed nothing"
    # what the end-to-end arm never reads moves neither its name nor its bytes
    for over in ("train.lr=0.5", "train.objective=noisy", "train.warmup_steps=3", "boundary.dtype=bfloat16",
                 "boundary.batch_size=2", "train.seed=5"):
        luigi.task_register.Register.clear_instance_cache()
        assert e2e(load_config("", over, "distill_tiny"), str(tmp_path)).out_dir == base.out_dir, over


def test_the_heal_matched_e2e_arm_hashes_the_healing_budget_and_not_distill_steps(tmp_path, run_graph):
    """The arm matched to blockwise + healing trains for that budget whatever distill.steps says:
    heal.steps and heal.batch_size are hashed (and change it), distill.steps is not."""
    def e2e(cfg, out):
        return build_distill_study(cfg, out).requires()["e2e_healed_model"]

    base = _build(e2e, "", tmp_path, run_graph)
    own = base.own_config()
    assert own["match_heal"] == {"steps": 3, "batch_size": 2} and "steps" not in own["distill"]
    ref = _weights(base)
    for over in ("heal.steps=5", "heal.batch_size=3"):
        t = _build(e2e, over, tmp_path, run_graph)
        assert t.out_dir != base.out_dir and _weights(t) != ref, over
    luigi.task_register.Register.clear_instance_cache()
    assert e2e(load_config("", "distill.steps=7", "distill_tiny"), str(tmp_path)).out_dir == base.out_dir


def test_a_hidden_term_without_an_interior_boundary_is_refused():
    from zgcore.checks import ConfigError

    for section in ("heal", "distill"):
        with pytest.raises(ConfigError, match=f"{section}.hidden_weight=0.5 matches the residual stream"):
            load_config("", f"boundary.num_blocks=1 {section}.hidden_weight=0.5", "distill_tiny")
