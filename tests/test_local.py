"""Greedy local learning on tiny models: isolation, K=1 = backprop, budget matching, MTP, memory, config errors."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from zgcore import local as zl
from zgcore.checks import ConfigError

torch.set_num_threads(1)

TINY_MODEL = {"n_layers": 4, "hidden_size": 32, "intermediate_size": 64, "n_heads": 4, "n_kv_heads": 2,
              "rope_theta": 10000.0, "vocab": "compact"}
V, T = 50, 16


def run_cfg(k=1, aux="mlp", mtp=(), mtp_n=2, steps=4, execution="together", seed=0, data_seed=0):
    train = {**zl.LOCAL_DEFAULTS["train"], "token_budget": steps * 4 * T, "batch_size": 4, "lr": 3e-3,
             "warmup_steps": 1, "seed": seed, "data_seed": data_seed, "execution": execution}
    loc = {**zl.LOCAL_DEFAULTS["local"], "K": k, "aux": aux, "mtp_boundaries": list(mtp), "mtp_n": mtp_n}
    return zl.normalise_run({"model": dict(TINY_MODEL), "train": train, "local": loc})


def tokens(n=24, seed=1):
    return np.random.default_rng(seed).integers(0, V, size=(n, T)).astype(np.int64)


def test_no_gradient_crosses_a_boundary():
    lm = zl.build_local(run_cfg(k=4, aux="transformer", mtp=[1, 2]), V, T)
    ids = torch.as_tensor(tokens(4))
    for j in range(1, lm.k):
        lm.zero_grad(set_to_none=True)
        losses = lm.block_losses(ids)
        losses[j].backward()
        for i in range(lm.k):
            got = [p.grad is not None and p.grad.abs().sum().item() > 0 for p in lm.block_params(i)]
            if i < j:  # earlier blocks: nothing at all from a later block's loss
                assert all(p.grad is None for p in lm.block_params(i)), (i, j)
            elif i == j:
                assert any(got), (i, j)
    # and each block's loss does reach its own block (block 0 included)
    lm.zero_grad(set_to_none=True)
    lm.block_losses(ids)[0].backward()
    assert lm.model.model.embed_tokens.weight.grad is not None
    assert all(p.grad is None for j in range(1, lm.k) for p in lm.block_params(j))


def test_k1_equals_ordinary_training_bit_for_bit():
    run = run_cfg(k=1, steps=5)
    data = tokens()
    lm = zl.build_local(run, V, T)
    zl.train_local(lm, data, run["train"])
    # ordinary end-to-end training, written out independently
    t = run["train"]
    torch.manual_seed(t["seed"])
    ref = AutoModelForCausalLM.from_config(zl.llama_config(run["model"], V, T))
    opt = torch.optim.AdamW(ref.parameters(), lr=t["lr"], weight_decay=t["weight_decay"])
    steps = zl.steps_for(t, T)
    for s in range(steps):
        ids = torch.as_tensor(data[zl.batch_indices(len(data), t["batch_size"], t["data_seed"], s)])
        for g in opt.param_groups:
            g["lr"] = zl.lr_at(s, steps, t["lr"], t["warmup_steps"])
        opt.zero_grad()
        logits = ref(input_ids=ids, use_cache=False).logits[:, :-1]
        F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), t["grad_clip"])
        opt.step()
    a, b = lm.model.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_per_block_execution_computes_the_same_update_with_less_activation_memory():
    data = tokens()
    lms = {}
    for mode in ("together", "per_block"):
        run = run_cfg(k=4, aux="mlp", mtp=[1], steps=3, execution=mode)
        lms[mode] = zl.build_local(run, V, T)
        m = zl.train_local(lms[mode], data, run["train"])
    a, b = lms["together"].state_dict(), lms["per_block"].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    mem = m["memory"]
    assert mem["together"]["saved_peak_bytes"] > mem["per_block"]["saved_peak_bytes"] > 0
    assert m["memory_ratio"] > 1.5
    # the meter sees real tensors: doubling the batch doubles what autograd keeps (within 10%)
    lm = lms["together"]
    one = zl.measure_activation_memory(lm, torch.as_tensor(data[:4]), "together")["saved_peak_bytes"]
    two = zl.measure_activation_memory(lm, torch.as_tensor(data[:8]), "together")["saved_peak_bytes"]
    assert 1.8 < two / one < 2.2
    assert all(p.grad is None for p in lm.parameters())


def test_token_budget_matching_same_ids_in_same_order():
    data = tokens(10)
    seen = {}
    for k, aux, mtp in ((1, "mlp", ()), (2, "transformer", (1,)), (4, "mlp", (1, 2, 3))):
        run = run_cfg(k=k, aux=aux, mtp=mtp, steps=7, seed=k)  # model seeds differ; data order must not
        m = zl.train_local(zl.build_local(run, V, T), data, run["train"])
        seen[k] = (m["tokens"], m["tokens_sha256"])
    assert len(set(seen.values())) == 1 and seen[1][0] == 7 * 4 * T
    # the stream wraps epochs without repeating or skipping a row within an epoch
    rows = np.concatenate([zl.batch_indices(10, 4, 0, s) for s in range(5)])
    assert sorted(rows[:10]) == list(range(10)) and sorted(rows[10:20]) == list(range(10))


def test_mtp_targets_are_the_right_shifted_tokens():
    ids = torch.arange(2 * 8).reshape(2, 8)
    tg = zl.mtp_targets(ids, 3)
    for k, t in enumerate(tg, start=1):
        assert t.shape == (2, 8 - k)
        for b in range(2):
            for pos in range(8 - k):
                assert t[b, pos] == ids[b, pos + k]
    # shifted_ce scores logits at t against ids at t+k: a one-hot oracle for offset 2 has ~zero loss there only
    logits = torch.full((2, 8, 16), -30.0)
    for b in range(2):
        for pos in range(6):
            logits[b, pos, ids[b, pos + 2] % 16] = 30.0
    small = ids % 16
    assert zl.shifted_ce(logits, small, 2) < 1e-6 and zl.shifted_ce(logits, small, 1) > 10
    # an MTP boundary's head returns one logits tensor per offset 1..n
    lm = zl.build_local(run_cfg(k=2, mtp=[1], mtp_n=3), V, T)
    x = torch.as_tensor(tokens(2))
    ctx = lm.context(x)
    assert len(lm.boundary_logits(0, lm.run_block(0, x, ctx), ctx)) == 3
    assert len(zl.build_local(run_cfg(k=2), V, T).heads[0].mtp) == 0


@pytest.mark.parametrize("over, msg", [
    ({"local.K": 5}, "local.K=5 exceeds the model's 4 layers"),
    ({"local.K": 2, "local.mtp_boundaries": [2]}, "MTP at boundary 2 does not exist"),
    ({"local.K": 2, "local.aux": "lstm"}, "local.aux must be one of mlp, transformer, none, got 'lstm'"),
    ({"study.aux": ["mlp", "conv"]}, "study.aux[1]='conv': study.aux must be a list of mlp, transformer"),
    ({"study.K": [1, 8]}, "local.K=8 exceeds"),
    ({"study.K": [2, 4]}, "must include 1"),
    ({"model.hidden_size": 30}, "divisible by model.n_heads"),
    ({"train.execution": "pipelined"}, "train.execution"),
    ({"model.bogus": 1}, "unknown key model.bogus;"),
])
def test_bad_configs_fail_at_once(over, msg):
    base = {"model": dict(TINY_MODEL), "study": {"K": [1, 2, 4]}}
    nested = {}
    for key, v in over.items():
        a, b = key.split(".")
        nested.setdefault(a, {})[b] = v
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        zl.resolve_local(base=base, overrides=nested)


def test_study_expansion_dedupes_and_keeps_one_baseline():
    cfg = zl.resolve_local(base={"model": dict(TINY_MODEL)})
    cells = zl.expand_study(cfg)
    assert [c["K"] for c in cells].count(1) == 1
    assert len(cells) == 1 + 2 * 3 + 2 * 3
    runs = {json.dumps(c["run"], sort_keys=True) for c in cells}
    assert len(runs) == 1 + 2 * 2 + 2 * 3  # K=2: "first" and "all" are the same run
    k4 = [c["run"]["local"]["mtp_boundaries"] for c in cells if c["K"] == 4 and c["aux"] == "mlp"]
    assert k4 == [[], [1], [1, 2, 3]]


def test_save_load_and_evaluate_per_boundary(tmp_path):
    run = run_cfg(k=2, aux="transformer", mtp=[1], steps=2)
    lm = zl.build_local(run, V, T)
    zl.train_local(lm, tokens(), run["train"])
    val = tokens(6, seed=3)
    ev = zl.evaluate_local(lm, val, 4)
    assert len(ev["boundary_ce"]) == 2 and all(0 < c < 10 for c in ev["boundary_ce"])
    zl.save_local(tmp_path, lm, np.arange(V), run)
    lm2, ids = zl.load_local(tmp_path)
    assert np.array_equal(ids, np.arange(V))
    assert zl.evaluate_local(lm2, val, 4)["boundary_ce"] == pytest.approx(ev["boundary_ce"])
    from zgcore.evaluation.metrics import cross_entropy
    assert cross_entropy(lm2.model, val, 4) == pytest.approx(ev["final_ce"], rel=1e-5)


def test_study_graph_runs_on_tiny_preset_and_reports(tmp_path, run_graph):
    from workflows import LocalLearningStudy
    from workflows.local import build_local_study, load_local_config

    out = str(tmp_path)
    over = "study.mtp=[off,all] study.aux=[mlp] train.token_budget=512"
    ok, ran = run_graph(LocalLearningStudy(preset="local_tiny", set=over, outputs=out))
    assert ok
    fams = [f for f, _ in ran]
    assert fams.count("PretrainLocal") == 5 and fams.count("EvaluateLocal") == 5 and "LocalStudyReport" in fams
    rep_task = build_local_study(load_local_config(overrides=over, preset="local_tiny"), out)
    rep = json.loads((rep_task.out_dir / "report.json").read_text())
    assert rep["token_budget"]["tokens"] == 512 and rep["token_budget"]["matched"]
    assert [(r["K"], r["mtp"]) for r in rep["rows"]] == [(1, "off"), (2, "off"), (2, "all"), (4, "off"), (4, "all")]
    assert all(len(r["boundary_ce"]) == r["K"] for r in rep["rows"])
    assert rep["rows"][0]["gap"] == 0 and rep["rows"][0]["memory_ratio"] == pytest.approx(1.0)
    assert all(r["memory_ratio"] > 1 for r in rep["rows"] if r["K"] > 1)
    assert (rep_task.out_dir / "gap_vs_k.png").stat().st_size > 1000
    assert "Token budget: 512 training tokens" in (rep_task.out_dir / "report.md").read_text()
    comps = {(c["a"], c["b"]): c for c in rep["comparisons"]}
    assert ("K=4 mlp", "K=1 (e2e)") in comps and ("K=4 mlp", "K=2 mlp") in comps and ("K=4 mlp MTP all", "K=4 mlp") in comps
    assert all({"mean_diff", "ci95", "seeds", "sequences", "verdict"} <= set(c) for c in comps.values())
    assert all(c["unit"] == "run" and c["runs"] == 1 and c["why"] == "fewer than 3 runs" for c in comps.values())
    assert rep["findings"]["gap_grows_with_k"]["status"] == "not resolved"  # one run, and a plumbing check
    assert not any(("K=1 (e2e)", n) in comps for n in ("K=4 mlp", "K=2 mlp"))  # no pair twice, either way round
    # unchanged: nothing reruns
    ok, ran = run_graph(LocalLearningStudy(preset="local_tiny", set=over, outputs=out))
    assert ok and [f for f, _ in ran if f != "LocalLearningStudy"] == []
    # the study is first-class on the command line: its tasks and its own report
    from typer.testing import CliRunner

    from workflows.cli import app

    r = CliRunner().invoke(app, ["report", "--preset", "local_tiny", "--set", over, "--outputs", out])
    assert r.exit_code == 0 and r.output.startswith("# Greedy local learning study — local-tiny"), r.output[:300]
    r = CliRunner().invoke(app, ["status", "--preset", "local_tiny", "--set", over, "--outputs", out], terminal_width=300)
    assert r.exit_code == 0 and "LocalStudyReport study" in r.output and r.output.count("PretrainLocal ") == 5
    r = CliRunner().invoke(app, ["report", "--preset", "local_tiny", "--set", over + " train.token_budget=256", "--outputs", out])
    assert r.exit_code == 1 and "LocalLearningStudy" in r.output and "--preset local_tiny" in r.output


def test_workflow_rejects_bad_config_before_any_task():
    from workflows import LocalLearningStudy

    with pytest.raises(ConfigError, match="exceeds the model's 4 layers"):
        LocalLearningStudy(preset="local_tiny", set="study.K=[1,2,8]")
    with pytest.raises(ConfigError, match="MTP at boundary 3 does not exist"):
        LocalLearningStudy(preset="local_tiny", set="study.K=[1] local.K=2 local.mtp_boundaries=[3]")
    with pytest.raises(ConfigError, match="unknown preset"):
        LocalLearningStudy(preset="nope")


def test_study_over_seeds_compares_runs_on_the_same_random_test_rows(tmp_path, run_graph):
    """Three seeds, each the whole run's randomness (initialisation and data order): method
    comparisons over runs ("unit": "run", "runs": 3, Holm-adjusted p), FLOPs per arm; over seeds
    [0, 1] (the runs reused) nothing is resolved (fewer than 3 runs); a smoke preset never concludes."""
    from workflows import LocalLearningStudy
    from workflows.local import build_local_study, load_local_config
    from zgcore.evaluation import compare

    over = "seeds=[0,1,2] study.K=[1,2] study.aux=[mlp] study.mtp=[off] train.token_budget=512 eval.max_sequences=4"
    ok, ran = run_graph(LocalLearningStudy(preset="local_tiny", set=over, outputs=str(tmp_path)))
    assert ok and [f for f, _ in ran].count("PretrainLocal") == 6
    report = build_local_study(load_local_config(overrides=over, preset="local_tiny"), str(tmp_path))
    rep = json.loads((report.out_dir / "report.json").read_text())
    assert [(r["K"], r["seed"]) for r in rep["rows"]] == [(1, 0), (2, 0), (1, 1), (2, 1), (1, 2), (2, 2)]
    assert rep["seeds"] == [0, 1, 2] and "batch order" in rep["seed_varies"]
    assert len({r["held_out_ce"] for r in rep["rows"]}) == 6  # the seeds differ
    models = [m for m in report.requires()["models"]]
    shas = {json.loads((m.out_dir / "metrics.json").read_text())["tokens_sha256"] for m in models}
    assert len(shas) == 3  # one token stream per seed: the seed sets the data order, shared by the seed's configurations
    (c,) = rep["comparisons"]
    assert (c["a"], c["b"], c["seeds"], c["sequences"], c["unit"], c["runs"]) == ("K=2 mlp", "K=1 (e2e)", [0, 1, 2], 4, "run", 3)
    if c["documents"] >= 2:  # a family of one
        assert c["p_adjusted"] == pytest.approx(c["p"]) and 0 < c["p"] <= 1
    else:  # one document: nothing to resample, so no interval and no p, and never a verdict
        assert c["p"] is None and c["p_adjusted"] is None and c["why"] == compare.FEW_DOCUMENTS
    assert c["mean_diff"] == pytest.approx(sum(r["gap"] for r in rep["rows"] if r["K"] == 2) / 3)
    assert c["verdict"] == "not resolved" and rep["descriptive"]  # local_tiny: a plumbing check
    assert all(r["flops"] == r["flops_per_step"] * r["steps"] > 0 for r in rep["rows"])
    k1, k2 = (next(r["flops"] for r in rep["rows"] if r["K"] == k) for k in (1, 2))
    assert k2 > k1  # the aux head costs compute the token budget does not show
    evals = [t for t in report.requires()["evaluations"]]
    parts = [compare.load_scores(t.out_dir / compare.SCORES)["val"] for t in evals]
    rows = {json.dumps(p["rows"]) for p in parts}
    assert len(rows) == 1 and json.loads(rows.pop()) != [0, 1, 2, 3]  # one random subset for all, not the first rows
    assert len(parts[0]["documents"]) == 4 and c["documents"] == len(set(parts[0]["documents"]))
    md = (report.out_dir / "report.md").read_text()
    assert "## Over seeds [0, 1, 2]" in md and "## Comparisons" in md and "**plumbing check: descriptive only**" in md
    assert "train FLOPs" in md and "a seed sets the whole run's randomness" in md
    runs = sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "tensorboard" / "local-tiny" / "PretrainLocal").iterdir())
    assert runs == ["K1-e2e-s0", "K1-e2e-s1", "K1-e2e-s2", "K2-mlp-s0", "K2-mlp-s1", "K2-mlp-s2"]  # study, arm, seed
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(next((tmp_path / "tensorboard" / "local-tiny" / "PretrainLocal").glob("K2-mlp-s0-*"))))
    acc.Reload()  # the tags docs/performance.md lists
    assert {"loss/ce_b1", "loss/ce_b2", "lr", "grad_norm/group0", "grad_norm/group1", "throughput/tokens_per_s",
            "throughput/data_wait_fraction"} <= set(acc.Tags()["scalars"])
    two = over.replace("seeds=[0,1,2]", "seeds=[0,1]")
    ok, ran = run_graph(LocalLearningStudy(preset="local_tiny", set=two, outputs=str(tmp_path)))
    assert ok and [f for f, _ in ran if f != "LocalLearningStudy"] == ["LocalStudyReport"]  # every run reused
    rep2 = json.loads((build_local_study(load_local_config(overrides=two, preset="local_tiny"), str(tmp_path)).out_dir
                       / "report.json").read_text())
    (c2,) = rep2["comparisons"]
    assert (c2["runs"], c2["verdict"], c2["why"], c2["p_adjusted"]) == (2, "not resolved", "fewer than 3 runs", None)
    assert c2["per_seed"] == c["per_seed"][:2] and all(f["status"] in ("not resolved", "not measured")
                                                         for f in rep2["findings"].values())
