"""Calibration of the run-level comparison (:func:`zgcore.evaluation.compare.compare`) by
simulation, in regimes other than the project's own: heavy-tailed per-sequence losses (t, 3 df),
unequal documents, unequal run spreads between the arms, a per-document difference shared by every
run, the top-k healing table's small run spread; 3 and 5 seeds; 64 and 512 sequences.

Each cell simulates studies with no true difference between the methods and counts verdicts. The
bound is 7%; with ``STUDIES`` studies a cell fails when its count exceeds the one-sided 95%
binomial critical value at 7% (an honest margin for the finite number of studies: a true rate of
7% fails a cell one time in twenty, a true rate of 12.7% — what the estimate that divided the
shared term by the runs gave in the small-run-spread regime — almost always). Seeded, so the
outcome is fixed. Power: a true difference of 3 run standard deviations of the difference with 5
seeds is found in at least 80% of studies at 512 sequences; the rate at 64 is reported (printed).
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import binom

from zgcore.evaluation import compare

STUDIES = 400  # per cell
BOUND = 0.07
CRITICAL = int(binom.ppf(0.95, STUDIES, BOUND))  # largest count of null verdicts a cell may show

# regime -> (run sd of arm a, run sd of arm b, per-sequence noise sd, shared per-document difference sd,
#            heavy tails, unequal documents, correlation of the two arms' per-sequence noise)
REGIMES = {
    "heavy_tailed": (0.03, 0.03, 0.3, 0.0, True, False, 0.0),
    "unequal_documents": (0.03, 0.03, 0.3, 0.0, False, True, 0.0),
    "unequal_run_spreads": (0.01, 0.05, 0.3, 0.0, False, False, 0.0),
    "shared_document_difference": (0.03, 0.03, 0.3, 0.03, False, False, 0.0),
    "small_run_spread": (0.003, 0.003, 0.05, 0.008, False, True, 0.98),  # the top-k healing table's regime
}


def _documents(n: int, unequal: bool, r: np.random.Generator) -> np.ndarray:
    """``[n]`` document id per sequence: ``n / 4`` documents of 4 rows, or ``max(10, n / 6)``
    documents of long-tailed sizes (Pareto weights: a few long documents, many of one or two rows;
    at 64 sequences exactly 10, the top-k table's regime and the minimum for a verdict)."""
    if not unequal:
        return np.repeat(np.arange(n // 4), 4)
    k = max(10, n // 6)
    w = r.pareto(1.5, k) + 1
    sizes = 1 + r.multinomial(n - k, w / w.sum())
    return np.repeat(np.arange(k), sizes)


def simulate(regime: str, seeds: int, n: int, shift_sds: float = 0.0, studies: int = STUDIES, seed: int = 0,
             judge=None) -> list[str]:
    """Verdicts of ``studies`` simulated two-arm studies (``seeds`` runs per arm, ``n`` shared test
    sequences) whose true difference is ``shift_sds`` run standard deviations of the difference;
    ``judge(ce_a, ce_b, docs)`` replaces :func:`compare.compare`'s verdict when given."""
    sa, sb, noise, shared, heavy, unequal, rho = REGIMES[regime]
    r = np.random.default_rng(seed)
    out = []
    for _ in range(studies):
        docs = _documents(n, unequal, r)
        g = int(docs.max()) + 1
        base = r.normal(4.0, 0.5, g)[docs] + r.normal(0, 0.5, n)  # per-sequence difficulty, common to both arms
        u = r.normal(0, shared, g)[docs] if shared else 0.0  # a per-document difference that repeats in every run
        shift = shift_sds * np.hypot(sa, sb)
        ce_a, ce_b = [], []
        for _s in range(seeds):
            if heavy:
                z = r.standard_t(3, (2, n)) / np.sqrt(3)
            else:
                z = r.normal(0, 1, (2, n))
            ea = noise * z[0]
            eb = noise * (rho * z[0] + np.sqrt(1 - rho ** 2) * z[1])
            ce_a.append(base + shift + u + r.normal(0, sa) + ea)
            ce_b.append(base + r.normal(0, sb) + eb)
        if judge is not None:
            out.append(judge(np.stack(ce_a), np.stack(ce_b), docs))
        else:
            out.append(compare.compare("a", "b", ce_a, ce_b, list(range(seeds)), groups=docs)["verdict"])
    return out


CELLS = [(reg, s, n) for reg in REGIMES for s in (3, 5) for n in (64, 512)]


@pytest.mark.parametrize("regime,seeds,n", CELLS, ids=[f"{r}-{s}seeds-{n}seq" for r, s, n in CELLS])
def test_null_studies_rarely_give_a_verdict(regime, seeds, n):
    v = simulate(regime, seeds, n, seed=CELLS.index((regime, seeds, n)))
    wrong = sum(x != compare.NOT_RESOLVED for x in v)
    assert wrong <= CRITICAL, f"{wrong}/{len(v)} verdicts with no true difference (bound {BOUND:.0%}: at most {CRITICAL})"


def _previous_estimate(ce_a: np.ndarray, ce_b: np.ndarray, docs: np.ndarray) -> str:
    """The verdict of the estimate this module replaced: ``se^2 = (var_s(d_s) + mean_s v_s) / R``
    (the shared per-document term divided by the runs)."""
    import math

    from scipy.stats import t

    d, r = ce_a - ce_b, len(ce_a)
    cl = compare.clusters(d.shape[1], docs)
    se = math.sqrt((np.var(d.mean(axis=1), ddof=1) + np.mean([compare.within_variance(x, cl) for x in d])) / r)
    return compare.A_BETTER if 2 * t.sf(abs(d.mean()) / se, r - 1) < 0.05 else compare.NOT_RESOLVED


def test_the_estimate_that_divides_the_shared_term_by_the_runs_fails_the_small_spread_cell():
    """The check can fail: the previous estimate gives too many verdicts with no true difference
    in the small-run-spread regime at 5 seeds (the reviewer's 12.7-15%); the crossed one does not."""
    old = simulate("small_run_spread", 5, 64, seed=5, judge=_previous_estimate)
    new = simulate("small_run_spread", 5, 64, seed=5)
    assert sum(x != compare.NOT_RESOLVED for x in old) > CRITICAL >= sum(x != compare.NOT_RESOLVED for x in new)


def test_power_at_three_run_sds_with_five_seeds():
    at_512 = simulate("unequal_run_spreads", 5, 512, shift_sds=-3.0, studies=200, seed=11)
    at_64 = simulate("unequal_run_spreads", 5, 64, shift_sds=-3.0, studies=200, seed=12)
    power = {n: sum(x == compare.A_BETTER for x in v) / len(v) for n, v in ((512, at_512), (64, at_64))}
    print(f"power at a true difference of 3 run sds, 5 seeds: {power[512]:.0%} at 512 sequences, {power[64]:.0%} at 64")
    assert power[512] >= 0.8 and compare.B_BETTER not in at_512 + at_64
    assert 0.3 <= power[64] <= power[512], power  # reported: fewer sequences cost power, never the sign


def test_two_runs_never_give_a_verdict_and_one_seed_over_two_documents_never_does():
    assert all(x == compare.NOT_RESOLVED for x in simulate("heavy_tailed", 2, 512, shift_sds=-10.0, studies=30, seed=12))
    r = np.random.default_rng(0)
    a = r.normal(4.0, 0.1, 200)
    c = compare.compare("a", "b", [a], [a + 3.0], [0], groups=np.repeat([0, 1], 100))  # 3 nats/token apart
    assert c["documents"] == 2 and c["verdict"] == compare.NOT_RESOLVED and c["why"] == compare.FEW_DOCUMENTS
    one = compare.compare("a", "b", [a], [a + 3.0 + r.normal(0, 0.1, 200)], [0], groups=np.zeros(200, int))
    assert one["p"] is None and one["ci95"] == [-np.inf, np.inf] and "—" in compare.markdown([one])  # never zero width
    assert "1 document (" in compare.sentence(one) and one["why"] == compare.FEW_DOCUMENTS
    c = compare.compare("a", "b", [a[:8]], [a[:8] + 3.0], [0])  # 8 independent sequences: below the minimum too
    assert c["independent"] and c["documents"] is None and c["why"] == compare.FEW_DOCUMENTS


def test_the_crossed_estimate_counts_each_component_once():
    """Against the formula written out, and against the variance of the grand mean over many
    simulated studies (runs and documents both sampled)."""
    r = np.random.default_rng(3)
    docs = np.repeat(np.arange(40), 5)
    d = np.stack([r.normal(0, 0.02) + np.repeat(r.normal(0, 0.05, 40), 5) * 0 + r.normal(0, 0.3, 200) for _ in range(4)])
    cl = compare.clusters(200, docs)
    v = lambda x: compare.within_variance(x, cl)
    want = np.var(d.mean(axis=1), ddof=1) / 4 + max(0.0, (4 * v(d.mean(axis=0)) - np.mean([v(x) for x in d])) / 3)
    c = compare.compare("a", "b", list(d), [np.zeros(200)] * 4, [0, 1, 2, 3], groups=docs)
    assert c["se"] ** 2 == pytest.approx(want) and c["df"] == 3 and c["documents"] == 40
    means, ses = [], []
    for _ in range(400):  # shared per-document term 0.05 (sd), run term 0.02, residual 0.3: 4 runs
        u = np.repeat(r.normal(0, 0.05, 40), 5)
        d = np.stack([r.normal(0, 0.02) + u + r.normal(0, 0.3, 200) for _ in range(4)])
        c = compare.compare("a", "b", list(d), [np.zeros(200)] * 4, [0, 1, 2, 3], groups=docs)
        means.append(c["mean_diff"])
        ses.append(c["se"] ** 2)
    truth = 0.02 ** 2 / 4 + 0.05 ** 2 / 40 + 0.3 ** 2 / 800
    assert np.var(means) == pytest.approx(truth, rel=0.2) and np.mean(ses) == pytest.approx(truth, rel=0.2)


def test_the_icc_says_how_much_each_sequences_difference_repeats():
    r = np.random.default_rng(4)
    shared = r.normal(0, 1.0, 300)
    repeats = compare.compare("a", "b", [shared + r.normal(0, 0.1, 300) for _ in range(3)], [np.zeros(300)] * 3, [0, 1, 2])
    fresh = compare.compare("a", "b", [r.normal(0, 1.0, 300) for _ in range(3)], [np.zeros(300)] * 3, [0, 1, 2])
    assert repeats["icc"] > 0.95 and abs(fresh["icc"]) < 0.1
    assert compare.compare("a", "b", [shared], [np.zeros(300)], [0])["icc"] is None
