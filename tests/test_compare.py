"""Comparisons: fixed models by a paired bootstrap over sequences, methods by a t interval over training
runs with Holm-adjusted p-values (and their calibration); the random test subset; out-of-domain held-out text."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import tiny_cfg
from zgcore.evaluation import compare
from zgcore.evaluation.metrics import eval_subset, tune_subset

FIELDS = {"a", "b", "mean_diff", "ci95", "seeds", "sequences", "verdict"}


def _arms(seed=0, n=200, gap=0.0, noise=0.3):
    r = np.random.default_rng(seed)
    base = r.normal(4.0, noise, n)
    return base, base + gap + r.normal(0, noise / 10, n)


def test_far_apart_arms_get_a_verdict_and_the_same_run_twice_is_not_resolved():
    a, b = _arms(gap=0.5)  # b is worse by 0.5 nats/token; the per-sequence noise of the difference is ~0.03
    c = compare.compare("a", "b", [a], [b], [0])
    assert FIELDS <= set(c) and c["verdict"] == "a better" and c["mean_diff"] == pytest.approx(-0.5, abs=0.01)
    lo, hi = c["ci95"]
    assert lo < c["mean_diff"] < hi < 0 and c["sequences"] == 200 and c["seeds"] == [0]
    flipped = compare.compare("b", "a", [b], [a], [0])
    assert flipped["verdict"] == "b better" and flipped["ci95"] == pytest.approx([-hi, -lo], abs=0.01)
    same = compare.compare("x", "y", [a], [a.copy()], [0])  # two arms that are the same run: identical CE
    assert same["verdict"] == "not resolved" and same["ci95"][0] <= 0 <= same["ci95"][1] and same["mean_diff"] == 0
    assert "not resolved" in compare.sentence(same) and "beats" in compare.sentence(c)


def test_a_difference_within_the_noise_is_not_resolved_and_seeds_are_runs():
    r = np.random.default_rng(1)
    a = [r.normal(4.0, 0.3, 100) for _ in range(3)]
    b = [x + r.normal(0, 0.3, 100) for x in a]  # same mean, large per-sequence noise
    c = compare.compare("a", "b", a, b, [0, 1, 2])
    assert c["verdict"] == "not resolved" and c["ci95"][0] < 0 < c["ci95"][1]
    assert c["unit"] == "run" and c["runs"] == 3 and c["p"] > 0.05 and c["p_adjusted"] is None
    assert c["seeds"] == [0, 1, 2] and len(c["per_seed"]) == 3 and "t interval over training runs" in c["method"]
    assert c["mean_diff"] == pytest.approx(np.mean(c["per_seed"])) and c["seed_std"] == pytest.approx(np.std(c["per_seed"], ddof=1))
    with pytest.raises(ValueError, match="same number of sequences"):
        compare.compare("a", "b", [a[0]], [b[0][:50]], [0])


def _runs(diffs, n=512, noise=0.01, seed=0):
    """Per-seed CE arrays of two arms whose mean difference on seed ``s`` is ``diffs[s]`` (a minus b),
    with small per-sequence noise."""
    r = np.random.default_rng(seed)
    base = r.normal(4.0, 0.5, n)
    a = [base + d + r.normal(0, noise, n) for d in diffs]
    return a, [base.copy() for _ in diffs]


def test_seeds_far_apart_are_not_resolved_and_tight_seeds_are():
    """Three runs differing by -0.002, -0.06 and -0.12 (each run's own interval tight) pooled as
    sequences once gave a narrow interval that excluded seed 0's own difference; as runs they do not
    resolve. Five runs at -0.10 +- 0.01 do."""
    a, b = _runs([-0.002, -0.06, -0.12])
    c = compare.compare("a", "b", a, b, [0, 1, 2])
    assert c["unit"] == "run" and c["runs"] == 3 and c["verdict"] == "not resolved"
    assert c["ci95"][0] < c["per_seed"][2] and c["per_seed"][0] < c["ci95"][1]  # every run's own estimate inside
    assert c["mean_diff"] == pytest.approx(-0.0607, abs=0.002) and c["p"] > 0.05
    a, b = _runs([-0.10, -0.11, -0.09, -0.095, -0.105])
    c = compare.compare("a", "b", a, b, [0, 1, 2, 3, 4])
    assert c["verdict"] == "a better" and c["why"] is None and c["p"] < 0.001 and c["ci95"][1] < 0


def test_two_runs_never_give_a_method_verdict_but_keep_their_estimates():
    a, b = _runs([-0.5, -0.51])  # far apart and consistent: still two runs
    c = compare.compare("t", "m", a, b, [0, 1])
    assert c["verdict"] == "not resolved" and c["why"] == "fewer than 3 runs" and c["runs"] == 2
    assert c["mean_diff"] == pytest.approx(-0.505, abs=0.003) and c["per_seed"][0] == pytest.approx(-0.5, abs=0.003)
    assert "fewer than 3 runs" in compare.sentence(c) and "-0.50" in compare.sentence(c)
    one = compare.compare("t", "m", a[:1], b[:1], [0])  # one seed: two fixed models, the bootstrap decides
    assert one["unit"] == "sequence" and one["verdict"] == "a better" and one["why"] is None and "fixed models" in one["method"]


def test_seeds_that_disagree_in_sign_are_not_resolved():
    a, b = _runs([-0.30, -0.31, -0.29, -0.30, 0.02], noise=0.001)
    c = compare.compare("t", "m", a, b, list(range(5)))
    assert c["p"] < 0.05 and c["verdict"] == "not resolved" and c["why"] == "the seeds disagree in sign"


def test_holm_adjusts_a_report_family_and_the_verdict_follows_the_adjusted_p():
    ps = [0.01, 0.04, 0.03, 0.20]
    fam = [{"unit": "run", "runs": 5, "p": p, "p_adjusted": None, "mean_diff": -1.0, "per_seed": [-1.0] * 5,
            "ci95": [-2.0, -0.5], "se": 0.2, "df": 4, "sequences": 100, "documents": 20, "a": "x", "b": "y", "seeds": [0, 1, 2, 3, 4]}
           for p in ps]
    fixed = {"unit": "sequence", "runs": 1, "p": 0.001, "p_adjusted": None, "mean_diff": -1.0, "per_seed": [-1.0],
             "ci95": [-2.0, -0.5], "verdict": "a better", "why": None}
    compare.holm(fam + [fixed])
    assert [c["p_adjusted"] for c in fam] == pytest.approx([0.04, 0.09, 0.09, 0.20])  # 4p, then 3p, 2p (monotone), p
    assert [c["verdict"] for c in fam] == ["a better", "not resolved", "not resolved", "not resolved"]
    assert fam[1]["why"] == compare.NOT_SIGNIFICANT and fam[3]["why"] == compare.CONTAINS_ZERO
    assert fixed["p_adjusted"] is None and fixed["verdict"] == "a better"
    # each family member's interval at the level Holm tests it at: widest for the smallest p (0.05 / 4)
    from scipy.stats import t
    assert fam[0]["ci_holm"] == pytest.approx([-1.0 - 0.2 * t.ppf(1 - 0.05 / 8, 4), -1.0 + 0.2 * t.ppf(1 - 0.05 / 8, 4)])
    assert fam[3]["ci_holm"] == pytest.approx([-1.0 - 0.2 * t.ppf(0.975, 4), -1.0 + 0.2 * t.ppf(0.975, 4)])
    assert "Holm-adjusted CI" in compare.sentence(fam[0]) and "(unadjusted)" in compare.sentence(fam[0])
    from scipy.stats import false_discovery_control  # noqa: F401  (the family is Holm's, not Benjamini-Hochberg's)


def test_compare_arms_compares_a_pair_once_and_clusters_by_document():
    r = np.random.default_rng(3)
    arms = {k: {s: r.normal(4, 0.3, 40) for s in range(3)} for k in ("x", "y")}
    cs = compare.compare_arms([("x", "y"), ("y", "x"), ("x", "x")], arms)
    assert [(c["a"], c["b"]) for c in cs] == [("x", "y")] and cs[0]["p_adjusted"] == cs[0]["p"]
    docs = np.repeat(np.arange(4), 10)  # 4 documents of 10 sequences: a shared per-document shift
    shift = np.repeat(r.normal(0, 0.3, 4), 10)
    a, b = [r.normal(4, 0.01, 40) + shift], [np.full(40, 4.0)]
    by_seq, by_doc = compare.compare("a", "b", a, b, [0]), compare.compare("a", "b", a, b, [0], groups=docs)
    w = lambda c: c["ci95"][1] - c["ci95"][0]
    assert by_doc["documents"] == 4 and by_seq["documents"] is None and w(by_doc) > 3 * w(by_seq)
    assert "documents" in by_doc["method"]


def test_the_bootstrap_is_reproducible_to_the_byte():
    a, b = _arms(gap=0.01, noise=0.2)
    one = json.dumps(compare.compare("a", "b", [a], [b], [0]), sort_keys=True)
    two = json.dumps(compare.compare("a", "b", [a], [b], [0]), sort_keys=True)
    assert one == two
    assert compare.compare("a", "b", [a], [b], [0], rng_seed=1)["ci95"] != json.loads(one)["ci95"]


def test_eval_subset_is_seeded_random_not_the_first_rows_and_hashed():
    rows = eval_subset(1000, 64, 0)
    assert len(rows) == 64 and len(set(rows.tolist())) == 64 and list(rows) == sorted(rows)
    assert rows.tolist() != list(range(64)) and rows.max() > 500  # spread over the split, not its first rows
    assert eval_subset(1000, 64, 0).tolist() == rows.tolist() and eval_subset(1000, 64, 1).tolist() != rows.tolist()
    assert eval_subset(10, 0, 0).tolist() == list(range(10)) == eval_subset(10, 50, 3).tolist()
    assert compare.subset_digest(rows) == compare.subset_digest(rows.copy()) != compare.subset_digest(rows[:-1])


def test_lr_searches_score_outside_the_test_subset_and_refuse_when_nothing_is_left():
    test, tune = eval_subset(100, 40, 7), tune_subset(100, 40, 7)
    assert len(tune) == 60 and not set(test.tolist()) & set(tune.tolist())  # disjoint ...
    assert sorted(test.tolist() + tune.tolist()) == list(range(100)) and list(tune) == sorted(tune)  # ... and the whole split
    assert tune_subset(100, 40, 8).tolist() != tune.tolist()  # follows the test subset's seed
    for m in (0, 100, 150):  # the test subset is the whole split: nothing to tune on
        with pytest.raises(ValueError, match=f"distill.lrs .*eval.max_sequences={m} puts all 100 in it: set eval.max_sequences below 100"):
            tune_subset(100, m, 0, "distill.lrs")


def test_stdlib_docstrings_is_deterministic_text():
    from zgcore.data.corpus import read_texts

    docs = read_texts({"source": "stdlib-docstrings", "text_field": "text"})
    assert len(docs) >= 10 and sum(len(t) for _, t in docs) > 30_000
    assert docs == read_texts({"source": "stdlib-docstrings", "text_field": "text"})
    assert docs[0][0] == "docstrings:collections/__init__" and "namedtuple" in docs[0][1]


def test_eval_extra_is_checked_at_construction():
    from workflows.experiment import load_config
    from zgcore.checks import ConfigError

    with pytest.raises(ConfigError, match="part of the training corpus python-stdlib"):
        load_config(overrides=tiny_cfg(**{"corpus.source": "python-stdlib", "eval.extra": "[stdlib-docstrings]"}), preset="")
    with pytest.raises(ConfigError, match="its source is the training corpus"):
        load_config(overrides=tiny_cfg(**{"eval.extra": "[pydoc]"}), preset="")
    with pytest.raises(ConfigError, match="matches no file"):
        load_config(overrides=tiny_cfg(**{"eval.extra": "[/nonexistent/*.txt]"}), preset="")
    assert load_config(preset="default")["eval"]["extra"] == ["stdlib-docstrings"]


EXTRA = '[{"source":"stdlib-docstrings","max_tokens":4096}]'


def test_seeds_extra_corpus_and_random_subset_end_to_end(tmp_path, run_graph):
    """Two seeds of a tiny experiment with an out-of-domain corpus and eval.max_sequences: every
    Evaluate scores the same random rows (not the first ones) of both held-out sets for all three
    models; the corpus is never an input of a training task; SeedSummary pools comparisons."""
    from luigi.task import flatten

    from workflows.cli import walk
    from workflows.experiment import build_experiment, load_config

    over = tiny_cfg(**{"seeds": "[0,1]", "eval.max_sequences": 6, "eval.extra": EXTRA})
    root = build_experiment(load_config(overrides=over, preset=""), str(tmp_path))
    ok, ran = run_graph(root)
    assert ok and [f for f, _ in ran].count("PrepareHeldOut") == 1
    evals = root.requires()
    reports = [json.loads((e.out_dir / "report.json").read_text()) for e in evals]
    scores = [compare.load_scores(e.out_dir / compare.SCORES) for e in evals]
    val_rows = [s["val"]["rows"] for s in scores]
    assert val_rows[0] == val_rows[1] and len(val_rows[0]) == 6 and val_rows[0] != list(range(6))
    for rep, sc in zip(reports, scores):
        (ex,) = rep["extra"]
        assert ex["name"] == "stdlib-docstrings" and ex["sequences"] == 6 and ex["of"] == 4096 // 32
        assert set(ex["cross_entropy"]) == {"teacher", "untrained", "student"} and "gap_recovered" in ex
        part = sc["extra"]["stdlib-docstrings"]
        assert {k: float(v.mean()) for k, v in part["ce"].items()} == pytest.approx(ex["cross_entropy"])
        assert part["rows"] != list(range(6)) and rep["subset"]["sha256"] == sc["val"]["subset_sha256"]
        assert len(part["documents"]) == 6  # each out-of-domain row's document, so its comparisons resample documents
        assert all(isinstance(c["documents"], int) for c in rep["comparisons"] if c.get("held_out"))
        assert rep["cross_entropy"]["student"] == pytest.approx(float(sc["val"]["ce"]["student"].mean()))
        assert {(c["a"], c["b"], c.get("held_out")) for c in rep["comparisons"]} == {
            ("student", "untrained", None), ("student", "teacher", None),
            ("student", "untrained", "stdlib-docstrings"), ("student", "teacher", "stdlib-docstrings")}
    assert "## In-domain and out-of-domain held-out text" in (evals[0].out_dir / "report.md").read_text()
    summary = json.loads((root.out_dir / "report.json").read_text())
    assert [r["extra"]["stdlib-docstrings"]["ce_student"] for r in summary["rows"]] == \
        [r["extra"][0]["cross_entropy"]["student"] for r in reports]
    assert "out of domain, stdlib-docstrings" in (root.out_dir / "report.md").read_text()
    assert [(c["a"], c["b"]) for c in summary["comparisons"]] == [("student", "untrained"), ("student", "teacher")]
    assert all(FIELDS <= set(c) and c["seeds"] == [0, 1] and c["sequences"] == 6 for c in summary["comparisons"])
    # never trained on: no training task reads it, and training hashes do not move with it
    tasks = walk(root)
    extra_task = next(t for t in tasks if t.get_task_family() == "PrepareHeldOut")
    for t in tasks:
        if t.get_task_family() in ("TrainBlock", "TeacherBoundary", "BoundaryShard", "PrepareCorpus", "Assemble"):
            assert extra_task not in flatten(t.requires())
    plain = build_experiment(load_config(overrides=tiny_cfg(**{"seeds": "[0,1]"}), preset=""), str(tmp_path))
    uids = lambda r: sorted(t.uid for t in walk(r) if t.get_task_family() in ("TrainBlock", "TeacherBoundary"))
    assert uids(plain) == uids(root)
    from zgcore.data.corpus import read_tokens

    train = {row.tobytes() for row in read_tokens(next(tmp_path.glob("PrepareCorpus/*/tokens.h5")), "train").astype(np.int64)}
    held = np.load(extra_task.out_dir / "tokens.npy").astype(np.int64)
    assert not any(row.tobytes() in train for row in held)


def test_the_quality_gate_needs_the_verdict_not_only_the_point_estimates():
    from zgcore.evaluation.report import experiment_report

    r = np.random.default_rng(2)
    untrained = r.normal(5.0, 1.0, 40)
    ce = {"teacher": 3.0, "untrained": float(untrained.mean())}
    resolved = untrained - 1.8 + r.normal(0, 0.01, 40)  # far better than untrained on every sequence
    noisy = untrained - 1.8 + r.normal(0, 20.0, 40)  # better on average, but within the noise
    for student, passed in ((resolved, True), (noisy, False)):
        c = compare.compare("student", "untrained", [student], [untrained], [0])
        rep = experiment_report({"teacher": "smollm2-135m", "cross_entropy": {**ce, "student": float(student.mean())},
                                 "comparisons": [c]}, {"gate_gap": 0.5, "gate_context": 0.8})
        assert rep["gates"]["quality"]["passed"] is passed, rep["gates"]["quality"]
        if passed:
            assert c["verdict"] == "a better" and rep["gap_recovered"] > 0.5
        else:
            assert c["verdict"] == "not resolved" and "not shown better" in rep["gates"]["quality"]["reason"]


def test_one_run_per_arm_prints_no_p_and_several_runs_print_theirs():
    from zgcore.evaluation.compare import compare_arms, markdown, sentence

    rng = np.random.default_rng(0)
    groups = [0] * 4 + [1] * 4  # 2 documents
    x = {s: rng.normal(3.0, 0.1, 8) for s in (0, 1)}
    y = {s: x[s] + 0.05 + rng.normal(0, 0.01, 8) for s in (0, 1)}
    one = compare_arms([("x", "y")], {"x": {0: x[0]}, "y": {0: y[0]}}, groups=groups)[0]
    assert one["unit"] == "run" and one["runs"] == 1 and one["p"] < 0.001  # the bootstrap's p stays in report.json
    row = markdown([one]).splitlines()[2].split(" | ")
    assert row[6] == "—" and "p <" not in sentence(one) and "no test (one run per arm)" in sentence(one), row
    two = compare_arms([("x", "y")], {"x": x, "y": y}, groups=groups)[0]
    assert two["runs"] == 2 and markdown([two]).splitlines()[2].split(" | ")[6] not in ("—", "")
    assert "; p " in sentence(two)
