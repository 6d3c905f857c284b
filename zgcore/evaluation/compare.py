"""Comparisons between arms of a study, and the verdict each supports.

Every study report (objective study, seeds, distillation study, local-learning study) compares
pairs of arms through :func:`compare`, corrects each report's method comparisons together with
:func:`holm`, and writes its findings with :func:`sentence`, so no report declares a finding its
evidence does not support.

Both arms are scored on the same held-out sequences (the same rows, in the same order:
:func:`zgcore.evaluation.metrics.test_subset` picks them, and :func:`check_same_sequences` checks their
digest). Per sequence, the mean next-token CE (nats/token) of each arm; per seed ``s`` and sequence
``i`` the difference ``d[s, i] = CE_a[s, i] - CE_b[s, i]``. Two kinds of comparison, said apart
by ``"unit"``:

* **Two fixed models** (one seed: the assembled student vs the teacher or the untrained student):
  ``"unit": "sequence"``. A percentile bootstrap of the mean of ``d`` over sequences, paired (both
  arms resampled together), with :data:`RESAMPLES` resamples from a fixed seed, so a report is
  reproducible to the byte. Where the corpus knows documents (``groups``: each sequence's
  document id) whole documents are resampled with their sequences (a cluster bootstrap), so
  neighbouring rows of one file are not counted as independent evidence. It describes these two
  models, not the methods that trained them.
* **Two methods or configurations** (two or more seeds, each seed one training run of each arm):
  ``"unit": "run"``. Each run's mean difference ``d_s`` is one observation; the interval is a
  t interval over the ``R`` runs (``scipy.stats.t``, ``R - 1`` degrees of freedom) whose variance
  is the between-run sample variance of ``d_s`` plus the mean within-run variance of ``d_s``
  (the sequence-level uncertainty of each run's mean, document-clustered where ``groups`` are
  given): ``se^2 = (var_s(d_s) + mean_s(v_s)) / R``. The between-run variance already contains the
  within-run term once, so this is conservative, never narrower than either source alone. The
  two-sided p-value is that t test's. Below :data:`MIN_RUNS` runs the verdict is ``"not resolved"``
  (``why`` = "fewer than 3 runs"), with the point estimate and each run's difference still given;
  a verdict also needs every run's own difference on its side.

The verdict is ``"a better"`` (a's CE lower) or ``"b better"`` when the interval excludes 0 (one
seed) or the p-value — the Holm-adjusted one once :func:`holm` has corrected the report's family —
is below ``1 - LEVEL`` (runs), else ``"not resolved"`` with ``why``.

Sources: the paired bootstrap for comparing two systems on one test set (Koehn, EMNLP 2004;
Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993; the cluster bootstrap, Field & Welsh,
JRSS B 2007); training runs as the unit of replication (Bouthillier et al., "Accounting for
variance in machine learning benchmarks", MLSys 2021); Holm, "A simple sequentially rejective
multiple test procedure", Scand. J. Statist. 1979.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from zgcore.markdown import num, table

RESAMPLES = 5000  # bootstrap resamples (at least 2,000 keep the 95% interval's ends stable)
BOOTSTRAP_SEED = 20190  # fixed: the same data always give the same interval
LEVEL = 0.95
ALPHA = 1 - LEVEL  # a run-level verdict needs p (Holm-adjusted in a report) below this
MIN_RUNS = 3  # training runs a method comparison needs before it may have a verdict
BATCH = 250  # resamples drawn at once: bounds memory (BATCH x clusters); fixed, as it orders the draws
A_BETTER, B_BETTER, NOT_RESOLVED = "a better", "b better", "not resolved"
SEQUENCE, RUN = "sequence", "run"  # the unit a comparison resamples: held-out sequences (fixed models) or training runs
# why a comparison is "not resolved"
CONTAINS_ZERO, SEEDS_DISAGREE = "the interval contains 0", "the seeds disagree in sign"
FEW_RUNS = f"fewer than {MIN_RUNS} runs"
NOT_SIGNIFICANT = f"p >= {ALPHA:g} after the Holm adjustment"
DESCRIPTIVE = "plumbing check: descriptive only"  # a smoke preset or a random teacher: never a verdict
SCORES = "per_sequence_ce.json"  # every evaluation's per-sequence CE (nats/token), beside its summary
METHOD_SEQUENCE = "paired percentile bootstrap over held-out {what} (fixed models)"
METHOD_RUN = ("t interval over training runs (scipy.stats.t, runs - 1 degrees of freedom); variance = between-run "
              "variance of each run's mean difference + mean within-run variance ({what}-clustered)")


def subset_digest(indices: np.ndarray) -> str:
    """SHA-256 (hex) of held-out row indices as little-endian int64: names the exact sequences an
    evaluation scored, so two arms can be checked to have scored the same ones."""
    return hashlib.sha256(np.ascontiguousarray(indices, dtype="<i8").tobytes()).hexdigest()


def scores_part(scores: Mapping[str, np.ndarray], indices: np.ndarray, documents: np.ndarray | None = None) -> dict[str, Any]:
    """Per-sequence CE of the models scored on one held-out set, as JSON-ready lists.

    Args:
        scores: model key -> ``[n]`` per-sequence mean CE (nats/token), every array as long as ``indices``.
        indices: ``[n]`` int rows of the held-out set that were scored, in scoring order.
        documents: ``[n]`` int document id of each scored row (the corpus's, where it records them), or None.

    Returns:
        ``{"rows": [n ints], "subset_sha256", "sequences", "ce": {key: [n floats]}}`` and, with
        ``documents``, ``"documents": [n ints]``.

    Raises:
        ValueError: an array of another length than ``indices`` or with a non-finite value.
    """
    out = {"rows": [int(i) for i in indices], "subset_sha256": subset_digest(np.asarray(indices)),
           "sequences": int(len(indices)), "ce": {}}
    if documents is not None:
        if len(documents) != len(indices):
            raise ValueError(f"{len(documents)} document ids for {len(indices)} scored rows")
        out["documents"] = [int(x) for x in documents]
    for k, v in scores.items():
        v = np.asarray(v, dtype=np.float64)
        if v.shape != (len(indices),) or not np.isfinite(v).all():
            raise ValueError(f"per-sequence CE of {k!r}: shape {v.shape} (expected ({len(indices)},)) or a non-finite value")
        out["ce"][k] = [float(x) for x in v]
    return out


def save_scores(path: str | os.PathLike, val: Mapping[str, Any], extra: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Write an evaluation's per-sequence CE to ``path`` (JSON, :data:`SCORES`): ``{"val": part,
    "extra": {corpus name: part}}`` with parts from :func:`scores_part` (the held-out split, then
    every ``eval.extra`` corpus)."""
    Path(path).write_text(json.dumps({"val": dict(val), "extra": dict(extra or {})}, sort_keys=True) + "\n")


def load_scores(path: str | os.PathLike) -> dict[str, Any]:
    """Read a :func:`save_scores` file, every ``ce`` list as a float64 ``np.ndarray`` (and
    ``documents``, where recorded, as int64)."""
    d = json.loads(Path(path).read_text())
    for part in [d["val"], *d.get("extra", {}).values()]:
        part["ce"] = {k: np.asarray(v, dtype=np.float64) for k, v in part["ce"].items()}
        if part.get("documents") is not None:
            part["documents"] = np.asarray(part["documents"], dtype=np.int64)
    return d


def check_same_sequences(digests: Sequence[str], what: str = "arms") -> None:
    """Raise ``RuntimeError`` unless every evaluation scored the same held-out rows (equal
    :func:`subset_digest`): a paired comparison on different sequences would be meaningless."""
    if len(set(digests)) > 1:
        raise RuntimeError(f"the {what} were scored on different held-out sequences ({len(set(digests))} distinct "
                           "subsets); rerun their evaluations with the same eval.max_sequences and eval.subset_seed")


def verdict(lo: float, hi: float) -> str:
    """``"a better"`` (interval below 0: a's CE lower), ``"b better"`` (above 0) or ``"not resolved"``
    (the interval contains 0, or is not finite)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return NOT_RESOLVED
    return A_BETTER if hi < 0 else B_BETTER if lo > 0 else NOT_RESOLVED


def _clusters(n: int, groups: Sequence[int] | None) -> np.ndarray:
    """``[n]`` int cluster index (0..G-1) of each sequence: its document, or itself without ``groups``."""
    if groups is None:
        return np.arange(n)
    g = np.asarray(groups)
    if g.shape != (n,):
        raise ValueError(f"groups: {g.shape[0] if g.ndim else 0} document ids for {n} sequences")
    return np.unique(g, return_inverse=True)[1].reshape(-1)


def within_variance(d: np.ndarray, cl: np.ndarray) -> float:
    """Variance of the mean of ``d`` ``[n]`` over sequences, clustered: with ``G`` clusters
    (``cl``: ``[n]`` cluster index) and residual sums ``E_g``, ``G / (G - 1) x sum_g E_g^2 / n^2``
    (the cluster-robust variance of a mean; each sequence its own cluster gives ``var(d) / n``)."""
    n, g = len(d), int(cl.max()) + 1
    if g < 2:
        return float("inf")
    e = np.bincount(cl, weights=d - d.mean(), minlength=g)
    return float(g / (g - 1) * (e ** 2).sum() / n ** 2)


def _bootstrap(d: np.ndarray, cl: np.ndarray, resamples: int, rng_seed: int) -> tuple[float, float, float]:
    """Percentile interval and two-sided bootstrap p of the mean of ``d`` ``[n]``, resampling clusters."""
    g = int(cl.max()) + 1
    sums, counts = np.bincount(cl, weights=d, minlength=g), np.bincount(cl, minlength=g).astype(np.float64)
    rng, stats = np.random.default_rng(int(rng_seed)), []
    for lo in range(0, int(resamples), BATCH):
        pick = rng.integers(0, g, size=(min(BATCH, int(resamples) - lo), g))
        stats.append(sums[pick].sum(axis=1) / counts[pick].sum(axis=1))
    s = np.concatenate(stats)
    a = (1 - LEVEL) / 2
    p = min(1.0, 2 * min(float((s <= 0).mean()), float((s >= 0).mean())))
    return float(np.quantile(s, a)), float(np.quantile(s, 1 - a)), p


def _judge(c: dict[str, Any]) -> None:
    """Set ``c["verdict"]`` and ``c["why"]`` from its interval (sequence) or p-value (runs), in place."""
    lo, hi = c["ci95"]
    if c["unit"] == SEQUENCE:
        v = verdict(lo, hi)
        c["verdict"], c["why"] = v, (CONTAINS_ZERO if v == NOT_RESOLVED else None)
        return
    if c["runs"] < MIN_RUNS:
        c["verdict"], c["why"] = NOT_RESOLVED, FEW_RUNS
        return
    p = c["p_adjusted"] if c["p_adjusted"] is not None else c["p"]
    if p is None or not p < ALPHA:
        c["verdict"] = NOT_RESOLVED
        c["why"] = NOT_SIGNIFICANT if c["p_adjusted"] is not None and c["p"] < ALPHA else CONTAINS_ZERO
        return
    v = A_BETTER if c["mean_diff"] < 0 else B_BETTER
    if not all((d < 0) if v == A_BETTER else (d > 0) for d in c["per_seed"]):
        c["verdict"], c["why"] = NOT_RESOLVED, SEEDS_DISAGREE
        return
    c["verdict"], c["why"] = v, None


def _decide(c: dict[str, Any]) -> None:
    """Set ``c["verdict"]`` and ``c["why"]`` (:func:`_judge`); a plumbing check (``"descriptive"``)
    never has a verdict: what would have been one is "not resolved" with ``why`` = :data:`DESCRIPTIVE`."""
    _judge(c)
    if c.get("descriptive") and c["verdict"] != NOT_RESOLVED:
        c["verdict"], c["why"] = NOT_RESOLVED, DESCRIPTIVE


def compare(a: str, b: str, ce_a: Sequence[np.ndarray], ce_b: Sequence[np.ndarray], seeds: Sequence[int],
            resamples: int = RESAMPLES, rng_seed: int = BOOTSTRAP_SEED, groups: Sequence[int] | None = None) -> dict[str, Any]:
    """Compare arm ``a`` with arm ``b`` on paired per-sequence held-out CE: two fixed models (one
    seed, ``"unit": "sequence"``) or two methods (two or more seeds, ``"unit": "run"``); see the
    module's docstring for both methods.

    Args:
        a, b: the arms' names (as the report calls them).
        ce_a, ce_b: one ``[n]`` array per seed (same order as ``seeds``) of per-sequence mean CE
            (nats/token), float; ``ce_a[s][i]`` and ``ce_b[s][i]`` score the same sequence ``i``,
            and every seed scores the same ``n`` sequences.
        seeds: the seeds the arrays belong to (one per array; one seed = one training run per arm).
        resamples: bootstrap resamples (one seed). rng_seed: seed of the bootstrap's generator.
        groups: ``[n]`` int document id of each sequence, or None (each sequence its own unit).

    Returns:
        ``{"a", "b", "unit" ("sequence" | "run"), "runs" (seeds), "mean_diff" (CE a minus CE b,
        nats/token, averaged over sequences and runs), "ci95": [lo, hi], "p" (two-sided; bootstrap
        for sequences, t test for runs), "p_adjusted" (None until :func:`holm`), "seeds",
        "sequences" (n), "documents" (clusters resampled; None without ``groups``), "verdict",
        "why" (why "not resolved", else None), "per_seed" (each run's mean difference),
        "seed_std" (their sample std; None for one seed), "within_se" (per run, the standard error
        of its mean difference over sequences), "resamples", "method"}``.

    Raises:
        ValueError: no seed, arrays of different lengths, fewer than 2 sequences, or a non-finite CE.
    """
    from scipy.stats import t as student_t

    if not seeds or len(ce_a) != len(seeds) or len(ce_b) != len(seeds):
        raise ValueError(f"compare({a!r}, {b!r}) needs one CE array per seed for each arm: "
                         f"{len(ce_a)} and {len(ce_b)} arrays for seeds {list(seeds)}")
    n = len(ce_a[0])
    if any(np.shape(x) != (n,) for x in (*ce_a, *ce_b)):
        raise ValueError(f"compare({a!r}, {b!r}): every arm and seed must score the same number of sequences")
    diffs = [np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64) for x, y in zip(ce_a, ce_b)]
    if n < 2:
        raise ValueError(f"compare({a!r}, {b!r}): a comparison needs at least 2 held-out sequences, got {n}")
    if not all(np.isfinite(d).all() for d in diffs):
        raise ValueError(f"compare({a!r}, {b!r}): a per-sequence CE is not finite")
    cl = _clusters(n, groups)
    what = "documents" if groups is not None else "sequences"
    per_seed = [float(d.mean()) for d in diffs]
    within = [within_variance(d, cl) for d in diffs]
    mean, r = float(np.mean(per_seed)), len(per_seed)
    if r == 1:
        if np.ptp(diffs[0]) == 0:  # no spread at all (e.g. the same run twice): the interval is the point
            lo = hi = mean
            p = 1.0 if mean == 0 else 0.0
        else:
            lo, hi, p = _bootstrap(diffs[0], cl, resamples, rng_seed)
        unit, method = SEQUENCE, METHOD_SEQUENCE.format(what=what)
    else:
        var = statistics.variance(per_seed) + float(np.mean(within))
        se = math.sqrt(var / r) if math.isfinite(var) else float("inf")
        q = float(student_t.ppf(1 - (1 - LEVEL) / 2, r - 1))
        lo, hi = mean - q * se, mean + q * se
        p = (1.0 if mean == 0 else 0.0) if se == 0 else float(2 * student_t.sf(abs(mean) / se, r - 1))
        unit, method = RUN, METHOD_RUN.format(what=what[:-1])
    c = {"a": a, "b": b, "unit": unit, "runs": r, "mean_diff": mean, "ci95": [lo, hi], "p": p, "p_adjusted": None,
         "seeds": [int(s) for s in seeds], "sequences": int(n),
         "documents": int(cl.max()) + 1 if groups is not None else None, "verdict": NOT_RESOLVED, "why": None,
         "per_seed": per_seed, "seed_std": statistics.stdev(per_seed) if r > 1 else None,
         "within_se": [math.sqrt(v) for v in within], "resamples": int(resamples) if r == 1 else 0, "method": method}
    _decide(c)
    return c


def holm(comparisons: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Correct one report's method comparisons (``"unit": "run"``) together, Holm–Bonferroni:
    sorted by raw p ascending, ``p_adj(i) = max_{j <= i} min(1, (m - j) x p(j))`` (0-based ``j``,
    ``m`` = the family's size); each such entry gets ``p_adjusted`` and its verdict is decided
    again on it. The family is the method comparisons that can have a verdict (at least
    :data:`MIN_RUNS` runs); fixed-model comparisons (``"unit": "sequence"``) and those with fewer
    runs keep ``p_adjusted`` None. Returns the
    comparisons (the same dicts, changed in place), in their order.

    Source: Holm, Scand. J. Statist. 6 (1979) 65-70."""
    fam = [c for c in comparisons if c.get("unit") == RUN and c.get("p") is not None and c.get("runs", 0) >= MIN_RUNS]
    running = 0.0
    for j, c in enumerate(sorted(fam, key=lambda c: c["p"])):
        running = max(running, min(1.0, (len(fam) - j) * c["p"]))
        c["p_adjusted"] = running
    for c in fam:
        _decide(c)
    return list(comparisons)


def descriptive(comparisons: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mark every comparison of a plumbing check (a smoke preset or a random teacher) descriptive:
    its figures stay, its verdict is ``"not resolved"`` — ``why`` says the statistical reason where
    there is one (e.g. fewer than 3 runs), else :data:`DESCRIPTIVE` (in place)."""
    for c in comparisons:
        c["descriptive"] = True
        _decide(c)
    return list(comparisons)


def as_method(c: dict[str, Any]) -> dict[str, Any]:
    """A one-seed :func:`compare` entry whose arms are methods (each trained once): labelled
    ``"unit": "run"`` with ``"runs": 1`` and ``"not resolved"`` (fewer than 3 runs); its interval
    stays the sequence bootstrap of those two runs, which describes the two models only (in place)."""
    c.update(unit=RUN, method=c["method"].replace("(fixed models)", "(one run per arm: describes these two models only)"))
    _decide(c)
    return c


def compare_arms(pairs: Sequence[tuple[str, str]], arms: Mapping[str, Mapping[int, np.ndarray]],
                 groups: Sequence[int] | None = None, methods: bool = True) -> list[dict[str, Any]]:
    """:func:`compare` for each ``(a, b)`` of ``pairs`` whose two arms were both measured, pooled
    over the seeds both have (ascending), then :func:`holm` over them (one report's family). A pair
    listed twice, either way round (``(a, b)`` and ``(b, a)``), is compared once. With ``methods``
    (arms are methods or configurations, the default) a one-seed comparison is a method comparison
    of one run (:func:`as_method`), never a verdict.

    Args:
        pairs: arm-name pairs, in the order the report lists them.
        arms: arm name -> {seed: per-sequence CE ``[n]`` (nats/token)}, every array over the same sequences.
        groups: ``[n]`` document id of each sequence (see :func:`compare`), or None.

    Returns:
        The comparisons, skipping pairs with an unmeasured arm or no common seed.
    """
    out, seen = [], set()
    for a, b in pairs:
        if a not in arms or b not in arms or frozenset((a, b)) in seen or a == b:
            continue
        seeds = sorted(set(arms[a]) & set(arms[b]))
        if seeds:
            seen.add(frozenset((a, b)))
            c = compare(a, b, [arms[a][s] for s in seeds], [arms[b][s] for s in seeds], seeds, groups=groups)
            out.append(as_method(c) if methods and c["unit"] == SEQUENCE else c)
    return holm(out)


def _evidence(c: Mapping[str, Any]) -> str:
    lo, hi = c["ci95"]
    ev = f"{num(c['mean_diff'], '+.4f')} nats/token, 95% CI [{num(lo, '+.4f')}, {num(hi, '+.4f')}]"
    if c.get("unit") == RUN:
        p = f"; p {num(c.get('p'), '.3g')}" + (f", Holm-adjusted {num(c['p_adjusted'], '.3g')}" if c.get("p_adjusted") is not None else "")
        per = ", ".join(num(x, "+.4f") for x in c["per_seed"])
        return f"{ev}{p}; {c['runs']} runs ({per} per run) x {c['sequences']} sequences"
    return f"{ev}, one run each x {c['sequences']} sequences (fixed models)"


def sentence(c: Mapping[str, Any]) -> str:
    """The one sentence a report may write about comparison ``c`` (:func:`compare`): which arm has
    the lower held-out CE and by how much, or that the comparison is not resolved and why (with
    its point estimate)."""
    ev = _evidence(c)
    if c["verdict"] == A_BETTER:
        return f"{c['a']} beats {c['b']} (CE difference {ev})"
    if c["verdict"] == B_BETTER:
        return f"{c['b']} beats {c['a']} (CE difference {c['a']} minus {c['b']} {ev})"
    why = c.get("why") or CONTAINS_ZERO
    why += f"; {DESCRIPTIVE}" if c.get("descriptive") and why != DESCRIPTIVE else ""
    return f"{c['a']} vs {c['b']}: not resolved ({why}; CE difference {ev})"


def markdown(comparisons: Sequence[Mapping[str, Any]]) -> str:
    """The comparisons table (CE in nats/token) and how it was computed, for a report's Markdown
    (a first column names the held-out text when an entry has ``"held_out"``)."""
    where = any(c.get("held_out") for c in comparisons)
    rows = [([c.get("held_out") or "in-domain"] if where else []) + [
        c["a"], c["b"], c.get("unit", SEQUENCE), c.get("runs", len(c["seeds"])), num(c["mean_diff"], "+.4f"),
        f"[{num(c['ci95'][0], '+.4f')}, {num(c['ci95'][1], '+.4f')}]", num(c.get("p"), ".3g"), num(c.get("p_adjusted"), ".3g"),
        f"**{c['verdict']}**" + (f" ({c['why']})" if c.get("why") and c["why"] != CONTAINS_ZERO else ""),
        ", ".join(num(x, "+.4f") for x in c["per_seed"]) if len(c["per_seed"]) > 1 else "—",
        num(c.get("seed_std"), ".4f"), c["sequences"]] for c in comparisons]
    head = (["held-out text"] if where else []) + ["a", "b", "unit", "runs", "CE a − b", "95% CI", "p", "p (Holm)", "verdict",
                                                   "per run", "run std", "sequences"]
    clustered = any(c.get("documents") for c in comparisons)
    return (table(head, rows) + "\n\n"
            "Method comparisons (unit **run**: arms trained with several seeds) treat each training run's mean "
            "difference over the same test sequences as one observation: a t interval over runs whose variance adds "
            "each run's within-run (sequence-level) variance to the between-run variance; the p-value is that t "
            f"test's, Holm-adjusted over the report's method comparisons, and a verdict needs at least {MIN_RUNS} "
            "runs, an adjusted p below 0.05 and every run's difference on the verdict's side. Fixed-model comparisons "
            f"(unit **sequence**: one run of each) are a paired percentile bootstrap over held-out "
            f"{'documents (each with its sequences)' if clustered else 'sequences'} from a fixed seed; they describe "
            "those two models, not a method. \"not resolved\" means the data cannot tell the arms apart; its "
            "point estimate is still shown.")
