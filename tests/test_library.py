"""The library of candidate blocks (SelectStudent, preset library_tiny): each candidate trained
once and shared with experiments, the exact choice per budget, incremental reruns, and the
heterogeneous student folder."""
from __future__ import annotations

import itertools
import json
import shutil

import luigi
import numpy as np
import pytest
import torch

from tests import conftest
from zgcore.checks import ConfigError
from zgcore.evaluation import selection


def _run(task):
    conftest.RAN.clear()
    res = luigi.build([task], local_scheduler=True, workers=1, log_level="WARNING", detailed_summary=True)
    assert res.scheduling_succeeded, res.summary_text
    return [(t.get_task_family(), t) for t in conftest.RAN]


def _families(ran):
    return sorted(f for f, _ in ran)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """The library_tiny graph run once: ``(cfg, report task, tasks that ran, outputs)``."""
    from workflows import load_config
    from workflows.library import build_library

    out = str(tmp_path_factory.mktemp("library"))
    cfg = load_config("", "", "library_tiny")
    task = build_library(cfg, out)
    ran = _run(task)
    return cfg, task, ran, out


def test_selection_equals_brute_force_on_random_libraries():
    rng = np.random.default_rng(0)
    for trial in range(40):
        sizes = rng.integers(1, 5, size=rng.integers(1, 5))
        deltas = [list(rng.normal(size=n)) for n in sizes]
        costs = [list(rng.integers(1, 1000, size=n).astype(float)) for n in sizes]
        low = selection.smallest_cost(costs)
        for budget in (low, low + 300, low + 1e4, sum(max(c) for c in costs)):
            got, want = selection.select(deltas, costs, budget), selection.brute_force(deltas, costs, budget)
            assert got["delta"] == pytest.approx(want["delta"], abs=1e-9), (trial, budget)
            assert got["cost"] <= budget
    with pytest.raises(ValueError, match="below the smallest"):
        selection.select([[0.0, 1.0]], [[5.0, 3.0]], 2.0)


def test_library_trains_each_candidate_once_and_reports(library):
    _cfg, task, ran, _out = library
    trained = [t for f, t in ran if f == "TrainBlock"]
    cands = [c for part in task.candidates for c in part]
    # 3 variants at each of 2 partitions, every one trained exactly once, no other block
    assert len(cands) == 6 and len(trained) == 6 and len({t.uid for t in trained}) == 6
    assert sorted(t.uid for t in trained) == sorted(s.block_task().uid for p in task.score_tasks() for s in p)
    rep = json.loads((task.out_dir / "report.json").read_text())
    assert len(rep["candidates"]) == 6 and [s["budget"] for s in rep["selections"]] == [b["budget"] for b in task.budgets]
    table = {(c["partition"], c["variant"]): c for c in rep["candidates"]}
    for c in rep["candidates"]:
        assert np.isfinite(c["ce_increase"]) and c["ce_increase"] == pytest.approx(c["ce"] - c["ce_teacher"])
        assert c["block_loss"] >= 0 and c["params"] > 0 and c["flops"] > 2 * c["params"] and c["kv_bytes"] > 0
    # costs from the shapes: one kept layer is a quarter of the 4-layer teacher; half the MLP of 2 layers
    # removes 2 x 3 x 32 x 32 weights; one KV head of 8 halves the 2 layers' KV bytes (4 layers: 256 bytes)
    one = table[(0, 0)]["params"]
    extra = task.teacher_cost["params"] - 4 * one
    assert extra == 32 and table[(0, 1)]["params"] == 2 * one - 2 * 3 * 32 * 32
    assert table[(0, 2)]["kv_bytes"] == task.teacher_cost["kv_bytes"] // 4 == 64
    for s in rep["selections"]:
        assert set(s) >= {"budget", "chosen", "params", "ce", "model"} and len(s["chosen"]) == 2
        # the exact choice equals a brute-force search over all 9 combinations
        best = None
        for combo in itertools.product(range(3), range(3)):
            cost = extra + sum(table[(i, v)]["params"] for i, v in enumerate(combo))
            d = sum(table[(i, v)]["ce_increase"] for i, v in enumerate(combo))
            if cost <= s["budget"] and (best is None or d < best[0]):
                best = (d, list(combo), cost)
        assert s["indices"] == best[1] and s["params"] == best[2] <= s["budget"]
        assert s["predicted_increase"] == pytest.approx(best[0]) and np.isfinite(s["ce"])
    assert (task.out_dir / "quality_size.png").stat().st_size > 1000
    assert len(rep["uniform"]) == 3 and "## Selected students" in (task.out_dir / "report.md").read_text()
    assert all("note" in c or c["verdict"] in ("a better", "b better", "not resolved") for c in rep["comparisons"])


def test_an_experiment_asking_for_a_candidate_block_reuses_it(library):
    from workflows import build_experiment, load_config
    from workflows.cli import walk

    _cfg, _task, _ran, out = library
    for over in ("train.n_layers=1", "train.n_layers=2 train.intermediate_size=32"):
        blocks = [t for t in walk(build_experiment(load_config("", over, "library_tiny"), out))
                  if t.get_task_family() == "TrainBlock"]
        assert len(blocks) == 2 and all(t.complete() for t in blocks), over


def test_budget_change_reruns_only_selection(library):
    from workflows import load_config
    from workflows.library import build_library

    _cfg, task, _ran, out = library
    rep = json.loads((task.out_dir / "report.json").read_text())
    keep = rep["selections"][1]
    # the same choice at a budget of exactly its cost: nothing is trained, scored or assembled again
    budgets = f"library.budgets=[{rep['selections'][0]['budget_raw']}, {keep['params']}, {rep['selections'][2]['budget_raw']}]"
    task2 = build_library(load_config("", budgets, "library_tiny"), out)
    ran = _run(task2)
    assert _families(ran) == ["LibraryReport", "SelectBudget"]
    rep2 = json.loads((task2.out_dir / "report.json").read_text())
    assert rep2["selections"][1]["indices"] == keep["indices"] and rep2["selections"][1]["model"] == keep["model"]


def test_adding_a_variant_trains_only_that_variant(library):
    from workflows import load_config
    from workflows.library import build_library

    _cfg, _task, _ran, out = library
    variants = "library.variants=[{n_layers: 1}, {n_layers: 2, mlp: 0.5}, {n_layers: 2, kv_heads: 1}, {n_layers: 1, mlp: 0.5}]"
    task2 = build_library(load_config("", variants, "library_tiny"), out)
    ran = _run(task2)
    trained = [t for f, t in ran if f == "TrainBlock"]
    assert sorted(t.block for t in trained) == [0, 1]
    assert all(t.train["n_layers"] == 1 and t.train["intermediate_size"] == 32 for t in trained)
    assert [f for f, _ in ran].count("ScoreCandidate") == 2


def test_infeasible_budget_fails_at_graph_build_naming_the_smallest():
    from workflows import load_config
    from workflows.library import library_plan

    with pytest.raises(ConfigError, match=r"library.budgets\[0\]=0.1 .*raise it to at least [\d,]+ \(or 0\.\d+\)"):
        library_plan(load_config("", "library.budgets=[0.1]", "library_tiny"))
    with pytest.raises(ConfigError, match="kv_heads=3 must divide"):
        library_plan(load_config("", "library.variants=[{kv_heads: 3}]", "library_tiny"))


def test_heterogeneous_student_loads_alone_and_equals_its_blocks(tmp_path, monkeypatch):
    """Blocks of different MLP widths and KV heads: the folder loads with AutoModelForCausalLM from
    itself alone, counts exactly the blocks' parameters, and computes the blocks run in order."""
    from transformers import AutoModelForCausalLM

    from zgcore.models import costs
    from zgcore.models.adapters import build_block, head_logits
    from zgcore.models.hetero import assemble_exact, save_student
    from zgcore.models.teacher import build_tiny, byte_tokenizer

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    teacher = AutoModelForCausalLM.from_pretrained(build_tiny("llama", tmp_path / "teacher"), dtype=torch.float32).eval()
    channels = [list(np.arange(64, dtype=float)[::-1]) for _ in range(4)]
    blocks = [build_block(teacher, [0], "teacher", 0, intermediate_size=24, channels=channels),
              build_block(teacher, [1, 2], "teacher", 0, kv_heads=1),
              build_block(teacher, [3], "random", 1, intermediate_size=40, kv_heads=1)]
    student = assemble_exact(teacher, blocks)
    save_student(student, byte_tokenizer(), tmp_path / "built" / "model")
    folder = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "built" / "model", folder)
    shutil.rmtree(tmp_path / "built")
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "ZGHeteroLlamaForCausalLM"
    layers = loaded.model.layers
    assert [lay.mlp.gate_proj.out_features for lay in layers] == [24, 64, 64, 40]
    assert [lay.self_attn.k_proj.out_features for lay in layers] == [16, 8, 8, 8]
    want = sum(costs.block_cost(teacher.config, k, w, kv, 32)["params"]
               for k, w, kv in (([0], 24, None), ([1, 2], None, 1), ([3], 40, 1)))
    want += costs.student_extra(teacher.config)["params"]
    assert costs.non_embedding_params(loaded) == want == costs.non_embedding_params(student)
    assert want < costs.non_embedding_params(teacher)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = teacher.get_input_embeddings()(ids)
        for b in blocks:
            h = b(h)
        by_blocks = head_logits(teacher, h)
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, by_blocks, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, teacher(input_ids=ids).logits, atol=1e-3)
    out = loaded.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)  # the per-layer KV cache works
    assert out.shape == (1, 9)


def test_kv_heads_start_from_the_mean_of_each_group():
    from zgcore.models.heads import group_kv
    from zgcore.models.teacher import tiny_config

    cfg = tiny_config("llama")  # 4 query heads of 8, 2 KV heads
    k = torch.arange(16 * 32, dtype=torch.float32).reshape(16, 32)
    out = group_kv({"self_attn.k_proj.weight": k, "self_attn.v_proj.weight": -k, "mlp.x": k}, cfg, 1)
    torch.testing.assert_close(out["self_attn.k_proj.weight"], (k[:8] + k[8:]) / 2)
    torch.testing.assert_close(out["self_attn.v_proj.weight"], -(k[:8] + k[8:]) / 2)
    assert out["mlp.x"] is k


def test_an_experiment_with_fewer_kv_heads_assembles_a_plain_folder(tmp_path):
    """train.kv_heads in an experiment: one KV count for every block, carried by the family's own
    config; blocks of different counts are refused before anything runs."""
    from transformers import AutoModelForCausalLM

    from workflows import load_config
    from zgcore.models.adapters import assemble, build_block, head_logits
    from zgcore.models.teacher import build_tiny

    teacher = AutoModelForCausalLM.from_pretrained(build_tiny("llama", tmp_path / "teacher"), dtype=torch.float32).eval()
    blocks = [build_block(teacher, [0, 1], "teacher", 0, kv_heads=1), build_block(teacher, [3], "teacher", 0, kv_heads=1)]
    student = assemble(teacher, blocks)
    assert type(student).__name__ == "LlamaForCausalLM" and student.config.num_key_value_heads == 1
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = teacher.get_input_embeddings()(ids)
        for b in blocks:
            h = b(h)
        torch.testing.assert_close(student(input_ids=ids).logits, head_logits(teacher, h), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="different kv_heads"):
        assemble(teacher, [blocks[0], build_block(teacher, [3], "teacher", 0)])
    with pytest.raises(ConfigError, match="kv_heads differ"):
        load_config("", "teacher=tiny-llama boundary.num_blocks=2 blocks.0.kv_heads=1", "tiny")
    with pytest.raises(ConfigError, match="kv_heads=4 must divide"):
        load_config("", "teacher=tiny-llama train.kv_heads=4", "tiny")
    with pytest.raises(ConfigError, match="fewer key-value heads are built for"):
        load_config("", "teacher=tiny-gpt2 train.kv_heads=1", "tiny")


def test_per_partition_variants_replace_the_common_list():
    from workflows import load_config
    from workflows.library import library_plan

    p = library_plan(load_config("", "library.blocks.1.variants=[{n_layers: 2}, {n_layers: 1, keep: importance}, "
                                     "{n_layers: 2}]", "library_tiny"))  # a repeated table is one candidate
    assert [[c["name"] for c in part] for part in p["candidates"]] == [
        ["1L spread mlp100%", "2L spread mlp50%", "2L spread mlp100% kv1"], ["2L spread mlp100%", "1L importance mlp100%"]]
    assert p["candidates"][1][1]["train"]["keep"] == "importance" and p["uniform"] == []  # no variant at both partitions
    with pytest.raises(ConfigError, match=r"library.blocks.1.variants\[0\].n_layers=3 exceeds|n_layers=3 exceeds"):
        library_plan(load_config("", "library.blocks.1.variants=[{n_layers: 3}]", "library_tiny"))
    with pytest.raises(ConfigError, match="unknown key"):
        load_config("", "library.variants=[{layers: 3}]", "library_tiny")
