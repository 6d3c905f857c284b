"""A learning-rate sweep per local-learning configuration in the Luigi graph, the tuning
split, a ``top:N`` vocabulary, tokens per parameter and the paper's three findings in the report."""
import json

import numpy as np
import pytest
import torch

from zgcore import local as zl
from zgcore.checks import ConfigError

torch.set_num_threads(1)

TINY_MODEL = {"n_layers": 4, "hidden_size": 32, "intermediate_size": 64, "n_heads": 4, "n_kv_heads": 2,
              "rope_theta": 10000.0, "vocab": "compact"}
SWEEP = ("study.K=[1,2] study.aux=[mlp] study.mtp=[off] study.lrs=[1e-2,1e-3,3e-3] study.lr_rounds=1 "
         "study.tune_sequences=6 model.vocab=top:40")


def test_top_n_vocabulary_on_a_hand_made_example():
    train = np.array([[5, 5, 3, 3, 9, 1], [7, 7, 7, 2, 2, 2]])
    # counts: 2 and 7 three times, 3 and 5 twice, 1 and 9 once; ties go to the smaller id
    assert zl.top_ids(train, 3).tolist() == [2, 7, 3]
    assert zl.top_ids(train, 5).tolist() == [2, 7, 3, 5, 1]
    ids = zl.vocab_ids(train, train[:0], "top:3", 100)
    assert ids.tolist() == [2, 3, 7, zl.UNK]  # sorted, then UNK (model id 3)
    assert zl.remap(np.array([[5, 2, 7, 3, 99]]), ids).tolist() == [[3, 0, 2, 1, 3]]
    assert zl.vocab_ids(train, train[:0], "top:50", 100).tolist() == [1, 2, 3, 5, 7, 9, zl.UNK]  # fewer distinct ids
    with pytest.raises(ValueError, match="outside the model's vocabulary"):  # compact / full have no UNK
        zl.remap(np.array([[4]]), np.array([1, 2, 3]))
    # in a study: the model's vocabulary is N + 1 ids
    cfg = zl.resolve_local(base={"model": {**TINY_MODEL, "vocab": "top:7"}})
    assert zl.parse_vocab(cfg["model"]["vocab"]) == ("top", 7)


@pytest.mark.parametrize("over, msg", [
    ({"model": {"vocab": "top:1"}}, "top:N needs an integer N >= 2"),
    ({"model": {"vocab": "top:ten"}}, "top:N needs an integer N >= 2"),
    ({"model": {"vocab": "top20"}}, "model.vocab must be 'compact', 'full' or 'top:N'"),
    ({"study": {"lrs": [1e-3, 0]}}, r"study.lrs\[1\]=0: study.lrs must be a list of distinct numbers > 0"),
    ({"study": {"lrs": [-1e-3]}}, r"study.lrs\[0\]=-0.001: study.lrs must be"),
    ({"study": {"lrs": [1e-3, None]}}, r"study.lrs\[1\]=None: study.lrs must be"),
    ({"study": {"lrs": [""]}}, r"study.lrs\[0\]='': study.lrs must be"),
    ({"study": {"lrs": "1e-3"}}, "study.lrs must be a list"),
    ({"study": {"lrs": [1e-3, 1e-3]}}, "repeats a learning rate"),
    ({"study": {"lrs": [1e-3], "tune_fraction": 0}}, r"study.tune_fraction must be a number in \(0, 1\]"),
    ({"study": {"lrs": [1e-3], "tune_fraction": 1.5}}, r"study.tune_fraction must be a number in \(0, 1\]"),
    ({"study": {"lrs": [1e-3], "tune_fraction": 0.001}}, "tuning budget below one batch"),
    ({"study": {"lrs": [1e-3], "tune_sequences": 0}}, "study.tune_sequences"),
    ({"study": {"lrs": [1e-3], "lr_rounds": 0}}, "study.lr_rounds"),
    ({"study": {"configs": [{"K": 2}]}}, "must include a configuration with K=1"),
    ({"study": {"configs": [{"K": 1}, {"K": 2, "head": "mlp"}]}}, r"unknown key study.configs\[1\]\.head;"),
    ({"study": {"configs": [{"K": 1}, {"K": 8}]}}, "local.K=8 exceeds"),
    ({"study": {"configs": [{"K": 1}, {"K": 2}, {"K": 2, "aux": "mlp"}]}}, "twice"),
])
def test_bad_sweep_vocab_and_config_lists_fail_at_construction(over, msg):
    base = {"model": dict(TINY_MODEL)}
    with pytest.raises(ConfigError, match=msg):
        zl.resolve_local(base=base, overrides=over)


def test_workflow_rejects_a_bad_sweep_before_any_task():
    from workflows import LocalLearningStudy

    with pytest.raises(ConfigError, match=r"study.lrs\[1\]=-1: study.lrs must be a list of distinct numbers > 0"):
        LocalLearningStudy(preset="local_tiny", set="study.lrs=[1e-3,-1]")
    with pytest.raises(ConfigError, match="tune_fraction"):
        LocalLearningStudy(preset="local_tiny", set="study.lrs=[1e-3] study.tune_fraction=2")


def test_explicit_configs_and_the_cpu_2tpp_preset():
    from workflows.cli import walk
    from workflows.local import build_local_study, load_local_config

    cfg = load_local_config(preset="local_cpu_2tpp")
    cells = zl.expand_study(cfg)
    assert [(c["K"], c["aux"], c["mtp"], list(c["run"]["local"]["mtp_boundaries"])) for c in cells] == [
        (1, "none", "off", []), (2, "mlp", "off", []), (4, "mlp", "off", []), (4, "transformer", "off", []),
        (4, "transformer", "first", [1]), (4, "transformer", "all", [1, 2, 3])]
    assert all(c["run"]["train"]["holdout_sequences"] == 256 for c in cells)
    fams = [t.get_task_family() for t in walk(build_local_study(cfg, "/nonexistent"))]
    n_lrs = len(cfg["study"]["lrs"])  # 4: 1e-3 .. 3e-2
    seeds = len(cfg["seeds"])  # 2: every configuration once per seed
    assert n_lrs == 4 and seeds == 2 and fams.count("ChooseLocalLR") == 6 * seeds
    assert fams.count("PretrainLocal") == 6 * n_lrs * seeds  # finals: dynamic
    # >= 2 tokens per non-embedding parameter: all parameters less embedding and LM head (V x d each)
    lm = zl.build_local(cells[0]["run"], 2049, 128)
    non_emb = sum(p.numel() for n, p in lm.model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    assert cfg["train"]["token_budget"] / non_emb >= 2
    # without a sweep nothing changes: no tuning split in any run (same hashes as before the sweep existed)
    plain = zl.expand_study(zl.resolve_local(base={"model": dict(TINY_MODEL)}))
    assert all("holdout_sequences" not in c["run"]["train"] for c in plain)


def test_tuning_split_is_disjoint_from_training_and_test_and_the_same_for_every_configuration():
    rng = np.random.default_rng(0)
    train = np.concatenate([np.arange(40)[:, None], rng.integers(100, 120, (40, 7))], axis=1)  # row i starts with i
    val = np.concatenate([np.arange(50, 55)[:, None], rng.integers(100, 120, (5, 7))], axis=1)
    runs = [zl.normalise_run({"model": dict(TINY_MODEL, vocab=v), "train": {**zl.LOCAL_DEFAULTS["train"], "holdout_sequences": 6},
                              "local": {**zl.LOCAL_DEFAULTS["local"], "K": k}}) for k, v in ((1, "full"), (2, "compact"))]
    firsts = []
    for run in runs:
        sp = zl.model_splits(train, val, run, 200)
        inv = lambda rows, sp=sp: set(sp["ids"][rows[:, 0]].tolist())  # model id -> tokenizer id of each row's first token
        tr, tu, va = inv(sp["train"]), inv(sp["tune"]), inv(sp["val"])
        assert len(tu) == 6 and len(tr) == 34 and not tu & tr and not tu & va and tr | tu == set(range(40))
        firsts.append((tr, tu))
    assert firsts[0] == firsts[1]  # identical in every configuration
    # top:N is counted on the rows trained on: the tuning rows' own first ids (seen nowhere else) are UNK
    top = zl.model_splits(train, val, {**runs[0], "model": dict(TINY_MODEL, vocab="top:60")}, 200)
    unk = len(top["ids"]) - 1
    assert (top["tune"][:, 0] == unk).all() and (top["train"][:, 0] != unk).all()
    assert set(top["ids"][top["train"][:, 0]].tolist()) == firsts[0][0]
    tr_idx, tu_idx = zl.holdout_split(40, 6, 0)
    assert np.array_equal(np.sort(np.concatenate([tr_idx, tu_idx])), np.arange(40))
    assert not np.array_equal(tu_idx, zl.holdout_split(40, 6, 1)[1])  # seeded (train.data_seed)
    with pytest.raises(ConfigError, match="leaves no training sequence"):
        zl.holdout_split(6, 6, 0)


def _cells_scores(ces, seeds=(0, 1, 2)):
    """Cells (K, aux, mtp) with per-sequence CE around the given means, one run per seed (tiny run and
    sequence noise: with 3 runs every gap resolved)."""
    r = np.random.default_rng(0)
    noise = r.normal(0, 0.5, 64)
    cells = [{"K": k, "aux": aux, "mtp": mtp, "seed": 0} for k, aux, mtp, _ in ces]
    arms = {zl.report.arm_name(c): {s: 5.0 + noise + (ce - 5.0) + r.normal(0, 0.002) + r.normal(0, 0.001, 64) for s in seeds}
            for c, (*_, ce) in zip(cells, ces)}
    from zgcore.evaluation.compare import compare_arms

    return compare_arms(zl.report.compared_pairs(cells), arms)


def test_paper_findings_come_from_the_verdicts():
    base = [(1, "none", "off", 5.0)]
    paper = base + [(2, "mlp", "off", 5.1), (4, "mlp", "off", 5.3), (4, "transformer", "off", 5.2),
                    (4, "transformer", "first", 5.15), (4, "transformer", "all", 5.25)]
    f = zl.paper_findings(_cells_scores(paper))
    assert {k: v["status"] for k, v in f.items()} == {
        "gap_grows_with_k": "reproduced", "transformer_beats_mlp": "reproduced", "mtp_first_best": "reproduced"}
    assert "K=2 mlp beats K=4 mlp" in f["gap_grows_with_k"]["detail"]
    opposite = base + [(2, "mlp", "off", 5.3), (4, "mlp", "off", 5.1), (4, "transformer", "off", 5.2),
                       (4, "transformer", "first", 5.25), (4, "transformer", "all", 5.22)]
    f = zl.paper_findings(_cells_scores(opposite))
    assert {v["status"] for v in f.values()} == {"not reproduced"}
    # two runs: the same figures never give a verdict, so no finding is reproduced or refuted
    f = zl.paper_findings(_cells_scores(paper, seeds=(0, 1)))
    assert {v["status"] for v in f.values()} == {"not resolved"} and "fewer than 3 runs" in f["gap_grows_with_k"]["detail"]
    # local beats end to end: K=4 above K=2 is no growing deficit
    lead = base + [(2, "mlp", "off", 4.7), (4, "mlp", "off", 4.8)]
    assert zl.paper_findings(_cells_scores(lead))["gap_grows_with_k"]["status"] == "not reproduced"
    # the same figures within the noise: nothing is declared
    tied = base + [(2, "mlp", "off", 5.1), (4, "mlp", "off", 5.1), (4, "transformer", "off", 5.1),
                   (4, "transformer", "first", 5.1)]
    r = np.random.default_rng(3)
    cells = [{"K": k, "aux": aux, "mtp": mtp, "seed": 0} for k, aux, mtp, _ in tied]
    from zgcore.evaluation.compare import compare_arms

    comps = compare_arms(zl.report.compared_pairs(cells),
                         {zl.report.arm_name(c): {0: r.normal(5.1, 0.5, 64)} for c in cells})
    assert {v["status"] for v in zl.paper_findings(comps).values()} == {"not resolved"}
    f = zl.paper_findings(_cells_scores(base + [(2, "mlp", "off", 5.1), (4, "transformer", "first", 5.2)]))
    assert {v["status"] for v in f.values()} == {"not measured"}


def test_choose_lr_is_the_argmin_ties_to_the_first_and_skips_diverged_runs():
    assert zl.choose_lr([1e-3, 3e-3, 1e-2], [4.0, 3.5, 3.9]) == 3e-3
    assert zl.choose_lr([1e-3, 3e-3], [3.5, 3.5]) == 1e-3
    assert zl.choose_lr([1e-3, 3e-3, 1e-2], [4.0, float("nan"), float("inf")]) == 1e-3
    with pytest.raises(ValueError, match="every learning rate"):
        zl.choose_lr([1e-3], [float("nan")])


def _tasks(out, over):
    from workflows.cli import walk
    from workflows.local import build_local_study, load_local_config

    report = build_local_study(load_local_config(overrides=over, preset="local_tiny"), str(out))
    return report, walk(report)


def test_sweep_graph_tunes_each_configuration_and_reports_at_its_best_lr(tmp_path, run_graph):
    from workflows import LocalLearningStudy

    over = SWEEP + " study.tune_fraction=0.5"
    ok, ran = run_graph(LocalLearningStudy(preset="local_tiny", set=over, outputs=str(tmp_path)))
    assert ok
    fams = [f for f, _ in ran]
    # 2 configurations x 3 lrs tuning runs (half budget) + 2 final runs; one choice per configuration
    assert fams.count("PretrainLocal") == 2 * 3 + 2 and fams.count("EvaluateLocal") == 2 * 3 + 2
    # the report starts, stops at its dynamic dependencies (the final runs) and starts again once they are done
    assert fams.count("ChooseLocalLR") == 2 and fams.count("LocalStudyReport") == 2
    report, tasks = _tasks(tmp_path, over)
    rep = json.loads((report.out_dir / "report.json").read_text())
    choices = [t for t in tasks if t.get_task_family() == "ChooseLocalLR"]
    for ch, row in zip(choices, rep["rows"]):
        got = json.loads((ch.out_dir / "choice.json").read_text())
        evs = [json.loads((e.out_dir / "eval.json").read_text()) for e in ch.requires()]
        assert [e["split"] for e in evs] == ["tune"] * 3 and all(e["val_sequences"] == 6 for e in evs)
        lrs = [float(e.setup["train"]["lr"]) for e in ch.requires()]
        ces = [e["held_out_ce"] for e in evs]
        assert lrs == [1e-3, 3e-3, 1e-2] == got["lrs"] and got["tune_ce"] == ces
        assert got["best_lr"] == lrs[int(np.argmin(ces))] == row["lr"] and row["tune_ce"] == ces
        assert all(e.requires()["model"].setup["train"]["token_budget"] == 512 for e in ch.requires())
    # every run saw the same token stream: the final runs (checked by the report) and the tuning runs
    tune_shas = {json.loads((e.requires()["model"].out_dir / "metrics.json").read_text())["tokens_sha256"]
                 for ch in choices for e in ch.requires()}
    assert len(tune_shas) == 1 and rep["token_budget"]["matched"] and rep["token_budget"]["tokens"] == 1024
    finals = report.dynamic_upstream()
    assert [json.loads((t.out_dir / "eval.json").read_text())["held_out_ce"] for t in finals[:2]] == \
        [r["held_out_ce"] for r in rep["rows"]]
    assert [float(t.setup["train"]["lr"]) for t in finals[:2]] == [r["lr"] for r in rep["rows"]]
    # tokens per non-embedding parameter
    tpp = rep["tokens_per_parameter"]
    lm = zl.build_local(zl.expand_study(zl.resolve_local(base={"model": {**TINY_MODEL, "vocab": "top:40"}}))[0]["run"],
                        rep["vocab_size"], 32)
    non_emb = sum(p.numel() for n, p in lm.model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    assert rep["vocab_size"] == 41 and tpp["non_embedding_parameters"] == non_emb and tpp["ratio"] == 1024 / non_emb
    md = (report.out_dir / "report.md").read_text()
    assert "## Learning-rate search" in md and "## The paper's three findings" in md and "Tokens per parameter" in md
    # the final runs are inputs like the static ones: a damaged final evaluation rebuilds it and the report only
    next(f for f in sorted(finals[1].out_dir.iterdir()) if f.name != "task.json").unlink()
    ok, ran = run_graph(LocalLearningStudy(preset="local_tiny", set=over, outputs=str(tmp_path)))
    assert ok and sorted({f for f, _ in ran if f != "LocalLearningStudy"}) == ["EvaluateLocal", "LocalStudyReport"]
    assert [f for f, _ in ran].count("EvaluateLocal") == 1
    ok, ran = run_graph(LocalLearningStudy(preset="local_tiny", set=over, outputs=str(tmp_path)))
    assert ok and [f for f, _ in ran if f != "LocalLearningStudy"] == []


def test_sweep_at_the_full_budget_reuses_the_tuning_runs(tmp_path, run_graph):
    from workflows import LocalLearningStudy

    over = "study.K=[1,2] study.aux=[mlp] study.mtp=[off] study.lrs=[1e-3,1e-2] study.lr_rounds=1 study.tune_sequences=6"
    ok, ran = run_graph(LocalLearningStudy(preset="local_tiny", set=over, outputs=str(tmp_path)))
    fams = [f for f, _ in ran]
    assert ok and fams.count("PretrainLocal") == 2 * 2  # the chosen tuning run is the final run
    assert fams.count("EvaluateLocal") == 2 * 2 + 2  # tuning split per lr, test split per configuration
    report, _ = _tasks(tmp_path, over)
    rep = json.loads((report.out_dir / "report.json").read_text())
    assert rep["sweep"]["tune_fraction"] == 1.0 and rep["token_budget"]["tokens"] == 1024


def test_search_seeds_apart_from_reported_seeds_and_a_flops_matched_arm(tmp_path, run_graph):
    """study.search_seeds: the lr is searched on seed 0 only; the reported runs retrain the chosen lr
    on seeds 1 and 2, which took no part in the search; the report lists each configuration's
    search runs and its reported runs apart, and every arm's FLOPs. study.flops_matched adds a K=1
    arm trained for as many steps as the most expensive configuration's FLOPs buy."""
    from workflows import LocalLearningStudy
    from workflows.local import build_local_study, load_local_config
    from zgcore.checks import ConfigError

    over = ("study.K=[1,2] study.aux=[mlp] study.mtp=[off] study.lrs=[1e-3,1e-2] study.lr_rounds=1 study.tune_sequences=6 "
            "model.vocab=top:40 seeds=[1,2] study.search_seeds=[0] study.flops_matched=true")
    with pytest.raises(ConfigError, match="overlap seeds"):
        load_local_config(overrides=over.replace("seeds=[1,2]", "seeds=[0,1]"), preset="local_tiny")
    ok, ran = run_graph(LocalLearningStudy(preset="local_tiny", set=over, outputs=str(tmp_path)))
    fams = [f for f, _ in ran]
    # 3 configurations (K=1, K=2, K=1 FLOPs-matched) x 2 lrs on seed 0, then 3 x 2 reported runs
    assert ok and fams.count("ChooseLocalLR") == 3 and fams.count("PretrainLocal") == 3 * 2 + 3 * 2
    report = build_local_study(load_local_config(overrides=over, preset="local_tiny"), str(tmp_path))
    rep = json.loads((report.out_dir / "report.json").read_text())
    assert sorted({r["seed"] for r in rep["rows"]}) == [1, 2] and rep["seeds"] == [1, 2]
    for r in rep["rows"]:
        (sr,) = r["search_runs"]
        assert sr["seed"] == 0 and sr["lrs"] == [1e-3, 1e-2] and r["lr"] == sr["best_lr"]
    assert "searched on seeds [0]" in rep["selection"] and "took no part in the search" in rep["selection"]
    matched = [r for r in rep["rows"] if r["flops_matched"]]
    local = [r for r in rep["rows"] if r["K"] == 2]
    e2e = [r for r in rep["rows"] if r["K"] == 1 and not r["flops_matched"]]
    assert len(matched) == 2 and all(r["arm"] == "K=1 (e2e, FLOPs-matched)" for r in matched)
    assert matched[0]["flops"] >= local[0]["flops"] > e2e[0]["flops"]  # matched in FLOPs, not in tokens
    assert matched[0]["flops"] - matched[0]["flops_per_step"] < local[0]["flops"]  # by at most one step
    assert matched[0]["tokens"] > local[0]["tokens"] == e2e[0]["tokens"]
    assert {(c["a"], c["b"]) for c in rep["comparisons"]} == {("K=2 mlp", "K=1 (e2e)"), ("K=2 mlp", "K=1 (e2e, FLOPs-matched)")}
    md = (report.out_dir / "report.md").read_text()
    assert "Search runs and reported runs" in md and "seed 0: " in md and "seed 1 at " in md and "train FLOPs" in md


def test_the_five_seed_preset_has_fresh_seeds_fixed_lrs_and_a_flops_matched_arm():
    """local_cpu_5seed: five runs per configuration (a method verdict needs three), seeds that took
    no part in local_cpu_10tpp's search (0 and 1), each configuration at its own fixed lr, and the
    FLOPs-matched K=1 arm sized to the most expensive configuration."""
    from workflows.local import build_local_study, load_local_config
    from zgcore.local.flops import run_flops

    cfg = load_local_config(preset="local_cpu_5seed")
    assert len(cfg["seeds"]) >= 5 and not set(cfg["seeds"]) & {0, 1} and not cfg["study"]["lrs"]
    cells = zl.expand_seeds(cfg)
    first = [c for c in cells if c["seed"] == cfg["seeds"][0]]
    n = len(cfg["study"]["configs"])  # K=1, K=2/K=4 MLP, K=4 Transformer without MTP, with MTP first, with MTP all
    assert n == 6 and len(cells) == (n + 1) * len(cfg["seeds"])
    assert [c.get("flops_matched", False) for c in first] == [False] * n + [True]
    assert [c["run"]["train"]["lr"] for c in first[:n]] == [float(c["lr"]) for c in cfg["study"]["configs"]]  # each its own
    total = [run_flops(c["run"], 1025, 128)["total"] for c in first]
    per_step = run_flops(first[n]["run"], 1025, 128)["per_step"]
    assert max(total[:n]) <= total[n] < max(total[:n]) + per_step  # matched to within one step
    assert {(c["run"]["train"]["seed"], c["run"]["train"]["data_seed"]) for c in cells} == {(s, s) for s in cfg["seeds"]}
    assert build_local_study(cfg).selection().startswith("each configuration trains at the lr its configuration names")
