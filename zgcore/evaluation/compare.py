"""Comparisons between arms of a study, and the verdict each supports.

Every report (the experiment, seeds, objective study, distillation study, local-learning study,
the library, the top-k table) compares pairs of arms through one entry point, :func:`compare_arms`,
which knows whether its arms are **fixed models** or **trained configurations**; it calls
:func:`compare` per pair, corrects the report's method comparisons together with :func:`holm`, and
reports write their findings with :func:`sentence`, so no report declares a finding its evidence
does not support.

Both arms are scored on the same held-out sequences (the same rows, in the same order:
:func:`zgcore.evaluation.metrics.test_subset` picks them, and :func:`check_same_sequences` checks their
digest). Per sequence, the mean next-token CE (nats/token) of each arm; per seed ``s`` and sequence
``i`` the difference ``d[s, i] = CE_a[s, i] - CE_b[s, i]``. Sequences are grouped in documents
where the corpus records them (``groups``); without them every sequence is its own unit and the
comparison says so (``"independent": True``, "sequences treated as independent"). Two kinds of
comparison, said apart by ``"unit"``:

* **Two fixed models** (one seed: the assembled student vs the teacher or the untrained student):
  ``"unit": "sequence"``. A percentile bootstrap of the mean of ``d`` over documents (each with its
  sequences; a cluster bootstrap), paired (both arms resampled together), with :data:`RESAMPLES`
  resamples from a fixed seed, so a report is reproducible to the byte. It describes these two
  models, not the methods that trained them.
* **Two methods or configurations** (each seed one training run of each arm): ``"unit": "run"``.
  The estimand is the difference between the methods on this kind of text: runs and documents are
  both samples. The variance counts each component once (crossed random effects, method of
  moments: :func:`zgcore.evaluation.estimators.crossed_variance`):
  ``se^2 = var_s(d_s) / R + max(0, (R V - mean_s v_s) / (R - 1))``, with ``d_s`` each run's mean
  difference, ``v_s`` its document-clustered variance and ``V`` the document-clustered variance
  of the mean of the run-averaged differences. A t interval with ``R - 1`` degrees of freedom
  (``scipy.stats.t``); the two-sided p-value is that t test's. ``icc`` says how strongly each
  sequence's difference repeats across runs. Below :data:`MIN_RUNS` runs the verdict is
  ``"not resolved"`` (``why`` = "fewer than 3 runs"); a verdict also needs every run's own
  difference on its side.

Either kind over fewer than :data:`MIN_DOCUMENTS` documents (or independent sequences) is
``"not resolved"`` (``why`` = "too few documents"), however large the difference. The verdict is
``"a better"`` (a's CE lower) or ``"b better"`` when the interval excludes 0 (fixed models) or the
Holm-adjusted p-value is below ``1 - LEVEL`` (runs), else ``"not resolved"`` with ``why``. The
family Holm corrects is one report's method comparisons; each gets ``ci_holm``, its interval at
the level Holm tests it at, printed beside the adjusted p.

Sources: the paired bootstrap for comparing two systems on one test set (Koehn, EMNLP 2004;
Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993; the cluster bootstrap, Field & Welsh,
JRSS B 2007); training runs as the unit of replication (Bouthillier et al., "Accounting for
variance in machine learning benchmarks", MLSys 2021); Holm, "A simple sequentially rejective
multiple test procedure", Scand. J. Statist. 1979.
"""
from __future__ import annotations

import math
import statistics
from typing import Any
from collections.abc import Mapping, Sequence

import numpy as np

from zgcore.evaluation.estimators import bootstrap, clusters, crossed_variance, icc, within_variance
from zgcore.evaluation.scores import (SCORES, check_same_sequences, load_scores, save_scores, scores_part,  # noqa: F401
                                      subset_digest)
from zgcore.markdown import num, table

RESAMPLES = 5000  # bootstrap resamples (at least 2,000 keep the 95% interval's ends stable)
BOOTSTRAP_SEED = 20190  # fixed: the same data always give the same interval
LEVEL = 0.95
ALPHA = 1 - LEVEL  # a run-level verdict needs p (Holm-adjusted in a report) below this
MIN_RUNS = 3  # training runs a method comparison needs before it may have a verdict
MIN_DOCUMENTS = 10  # documents (or independent sequences) any comparison needs before it may have a verdict
A_BETTER, B_BETTER, NOT_RESOLVED = "a better", "b better", "not resolved"
SEQUENCE, RUN = "sequence", "run"  # the unit a comparison resamples: held-out sequences (fixed models) or training runs
# why a comparison is "not resolved"
CONTAINS_ZERO, SEEDS_DISAGREE = "the interval contains 0", "the seeds disagree in sign"
FEW_RUNS = f"fewer than {MIN_RUNS} runs"
FEW_DOCUMENTS = f"too few documents (fewer than {MIN_DOCUMENTS})"
NOT_SIGNIFICANT = f"p >= {ALPHA:g} after the Holm adjustment"
DESCRIPTIVE = "plumbing check: descriptive only"  # a smoke preset or a random teacher: never a verdict
INDEPENDENT = "sequences treated as independent (the corpus records no documents)"
METHOD_SEQUENCE = "paired percentile bootstrap over held-out {what} (fixed models)"
METHOD_RUN = ("t interval over training runs (scipy.stats.t, runs - 1 degrees of freedom); crossed runs x {what}s, "
              "each variance component once: var_s(d_s)/R + max(0, (R V - mean v_s)/(R - 1))")


def p_text(p: float | None) -> str:
    """A p-value for a report: ``"< 0.001"`` below 0.001 (never ``"0"``), else 3 significant digits."""
    if p is None or not isinstance(p, (int, float)) or not math.isfinite(p):
        return num(p, ".3g")
    return "< 0.001" if p < 0.001 else format(p, ".3g")


def tested_p(c: Mapping[str, Any]) -> float | None:
    """The p of comparison ``c`` that a report may print: None where no test applies, that is a
    method comparison (unit ``run``) of one run per arm, which has no t test over runs (its
    ``"p"`` is the sequence bootstrap of two fixed models)."""
    return None if c.get("unit") == RUN and int(c.get("runs") or 0) < 2 else c.get("p")


def runs_text(r: int) -> str:
    """``"1 run"``, ``"3 runs"``."""
    return f"{r} run" if r == 1 else f"{r} runs"


def verdict(lo: float, hi: float) -> str:
    """``"a better"`` (interval below 0: a's CE lower), ``"b better"`` (above 0) or ``"not resolved"``
    (the interval contains 0, or is not finite)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return NOT_RESOLVED
    return A_BETTER if hi < 0 else B_BETTER if lo > 0 else NOT_RESOLVED


def _judge(c: dict[str, Any]) -> None:
    """Set ``c["verdict"]`` and ``c["why"]`` from its interval (sequence) or p-value (runs), in place."""
    lo, hi = c["ci95"]
    few_docs = (c.get("documents") or c.get("sequences", 0)) < MIN_DOCUMENTS
    if c["unit"] == SEQUENCE:
        v = verdict(lo, hi)
        c["verdict"], c["why"] = v, (CONTAINS_ZERO if v == NOT_RESOLVED else None)
        if few_docs:
            c["verdict"], c["why"] = NOT_RESOLVED, FEW_DOCUMENTS
        return
    if c["runs"] < MIN_RUNS:
        c["verdict"], c["why"] = NOT_RESOLVED, FEW_RUNS
        return
    if few_docs:
        c["verdict"], c["why"] = NOT_RESOLVED, FEW_DOCUMENTS
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


def _t_interval(mean: float, se: float, df: int, level: float) -> list[float]:
    from scipy.stats import t as student_t

    q = float(student_t.ppf(1 - (1 - level) / 2, df))
    return [mean - q * se, mean + q * se]


def compare(a: str, b: str, ce_a: Sequence[np.ndarray], ce_b: Sequence[np.ndarray], seeds: Sequence[int],
            resamples: int = RESAMPLES, rng_seed: int = BOOTSTRAP_SEED, groups: Sequence[int] | None = None) -> dict[str, Any]:
    """Compare arm ``a`` with arm ``b`` on paired per-sequence held-out CE: two fixed models (one
    seed, ``"unit": "sequence"``) or two methods (two or more seeds, ``"unit": "run"``); see the
    module's docstring for both methods. Reports call :func:`compare_arms`, which says which kind
    its arms are.

    Args:
        a, b: the arms' names (as the report calls them).
        ce_a, ce_b: one ``[n]`` array per seed (same order as ``seeds``) of per-sequence mean CE
            (nats/token), float; ``ce_a[s][i]`` and ``ce_b[s][i]`` score the same sequence ``i``,
            and every seed scores the same ``n`` sequences.
        seeds: the seeds the arrays belong to (one per array; one seed = one training run per arm).
        resamples: bootstrap resamples (one seed). rng_seed: seed of the bootstrap's generator.
        groups: ``[n]`` int document id of each sequence, or None (the corpus records no documents:
            each sequence its own unit, ``"independent": True``).

    Returns:
        ``{"a", "b", "unit" ("sequence" | "run"), "runs" (seeds), "mean_diff" (CE a minus CE b,
        nats/token, averaged over sequences and runs), "ci95": [lo, hi] (unadjusted), "p"
        (two-sided; bootstrap for sequences, t test for runs), "p_adjusted" and "ci_holm" (None
        until :func:`holm`), "se" and "df" (runs), "seeds", "sequences" (n), "documents" (clusters
        resampled; None without ``groups``), "independent" (no documents: sequences treated as
        independent), "verdict", "why" (why "not resolved", else None), "per_seed" (each run's
        mean difference), "seed_std" (their sample std; None for one seed), "within_se" (per run,
        the document-clustered standard error of its mean difference), "icc" (of ``d[s, i]``
        across runs; None for one run), "variance" (the crossed estimate's parts; runs),
        "resamples", "method"}``.

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
    diffs = np.stack([np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64) for x, y in zip(ce_a, ce_b)])
    if n < 2:
        raise ValueError(f"compare({a!r}, {b!r}): a comparison needs at least 2 held-out sequences, got {n}")
    if not np.isfinite(diffs).all():
        raise ValueError(f"compare({a!r}, {b!r}): a per-sequence CE is not finite")
    cl = clusters(n, groups)
    what = "documents" if groups is not None else "sequences"
    per_seed = [float(d.mean()) for d in diffs]
    within = [within_variance(d, cl) for d in diffs]
    mean, r = float(np.mean(per_seed)), len(per_seed)
    se = df = parts = None
    if int(cl.max()) < 1:  # one document: nothing to resample, no interval and no p (never a zero-width interval)
        lo, hi, p = -math.inf, math.inf, None
        unit, method = (SEQUENCE, METHOD_SEQUENCE.format(what=what)) if r == 1 else (RUN, METHOD_RUN.format(what=what[:-1]))
    elif r == 1:
        if np.ptp(diffs[0]) == 0:  # no spread at all (e.g. the same run twice): the interval is the point
            lo = hi = mean
            p = 1.0 if mean == 0 else 0.0
        else:
            lo, hi, p = bootstrap(diffs[0], cl, resamples, rng_seed, LEVEL)
        unit, method = SEQUENCE, METHOD_SEQUENCE.format(what=what)
    else:
        var, parts = crossed_variance(diffs, cl)
        se, df = (math.sqrt(var) if math.isfinite(var) else float("inf")), r - 1
        lo, hi = _t_interval(mean, se, df, LEVEL)
        p = (1.0 if mean == 0 else 0.0) if se == 0 else float(2 * student_t.sf(abs(mean) / se, df))
        unit, method = RUN, METHOD_RUN.format(what=what[:-1])
    if groups is None:
        method += f"; {INDEPENDENT}"
    c = {"a": a, "b": b, "unit": unit, "runs": r, "mean_diff": mean, "ci95": [lo, hi], "p": p, "p_adjusted": None,
         "ci_holm": None, "se": se, "df": df, "seeds": [int(s) for s in seeds], "sequences": int(n),
         "documents": int(cl.max()) + 1 if groups is not None else None, "independent": groups is None,
         "verdict": NOT_RESOLVED, "why": None, "per_seed": per_seed,
         "seed_std": statistics.stdev(per_seed) if r > 1 else None, "within_se": [math.sqrt(v) for v in within],
         "icc": icc(diffs), "variance": parts, "resamples": int(resamples) if r == 1 else 0, "method": method}
    _decide(c)
    return c


def holm(comparisons: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Correct one report's method comparisons (``"unit": "run"``) together, Holm–Bonferroni:
    sorted by raw p ascending, ``p_adj(i) = max_{j <= i} min(1, (m - j) x p(j))`` (0-based ``j``,
    ``m`` = the family's size); each such entry gets ``p_adjusted``, ``ci_holm`` (its t interval
    at level ``1 - ALPHA / (m - j)``, the level Holm tests it at; :data:`LEVEL` for a family of
    one) and its verdict is decided again on the adjusted p. The family is the method comparisons
    that can have a verdict (at least :data:`MIN_RUNS` runs); fixed-model comparisons
    (``"unit": "sequence"``) and those with fewer runs keep ``p_adjusted`` None. Returns the
    comparisons (the same dicts, changed in place), in their order.

    Source: Holm, Scand. J. Statist. 6 (1979) 65-70."""
    fam = [c for c in comparisons if c.get("unit") == RUN and c.get("p") is not None and c.get("runs", 0) >= MIN_RUNS]
    running = 0.0
    for j, c in enumerate(sorted(fam, key=lambda c: c["p"])):
        running = max(running, min(1.0, (len(fam) - j) * c["p"]))
        c["p_adjusted"] = running
        if c.get("se") is not None and c.get("df"):
            c["ci_holm"] = _t_interval(c["mean_diff"], c["se"], c["df"], 1 - ALPHA / (len(fam) - j))
            c["holm_level"] = 1 - ALPHA / (len(fam) - j)
    for c in fam:
        _decide(c)
    return list(comparisons)


def descriptive(comparisons: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mark every comparison of a plumbing check (a smoke preset or a random teacher) descriptive:
    its figures stay, its verdict is ``"not resolved"`` — ``why`` says the statistical reason where
    there is one (e.g. fewer than 3 runs), else :data:`DESCRIPTIVE` (in place)."""
    for c in comparisons:
        if "verdict" in c:
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
    """The one entry point of every report's comparisons: :func:`compare` for each ``(a, b)`` of
    ``pairs`` whose two arms were both measured, pooled over the seeds both have (ascending), then
    :func:`holm` over them (one report's family). A pair listed twice, either way round, is
    compared once.

    Args:
        pairs: arm-name pairs, in the order the report lists them.
        arms: arm name -> {seed: per-sequence CE ``[n]`` (nats/token)}, every array over the same sequences.
        groups: ``[n]`` document id of each sequence (see :func:`compare`), or None (the corpus
            records no documents: the comparisons say the sequences were treated as independent).
        methods: True (the default) when the arms are **trained configurations** (a method or a
            setting, each seed one training run): unit ``run``, a verdict from at least
            :data:`MIN_RUNS` runs only (one run: :func:`as_method`); False when they are **fixed
            models** (unit ``sequence``: these models, not how they were made).

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


def _ci(ci: Sequence[float] | None) -> str:
    if ci is None or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in ci):
        return "—"  # none computed, or one document: nothing to resample
    return f"[{num(ci[0], '+.4f')}, {num(ci[1], '+.4f')}]"


def _units(c: Mapping[str, Any]) -> str:
    docs = (f"{c['documents']} documents" if c.get("documents") is not None
            else "no documents: sequences treated as independent")
    docs = docs.replace("1 documents", "1 document") if c.get("documents") == 1 else docs
    return f"{c['sequences']} sequences, {docs}"


def _evidence(c: Mapping[str, Any]) -> str:
    ev = f"{num(c['mean_diff'], '+.4f')} nats/token, 95% CI {_ci(c['ci95'])} (unadjusted)"
    if c.get("ci_holm") is not None:
        ev += f", Holm-adjusted CI {_ci(c['ci_holm'])}"
    if c.get("unit") == RUN:
        p = (f"; p {p_text(tested_p(c))}" if tested_p(c) is not None else "; no test (one run per arm)") + (
            f", Holm-adjusted {p_text(c['p_adjusted'])}" if c.get("p_adjusted") is not None else "")
        per = ", ".join(num(x, "+.4f") for x in c["per_seed"])
        return f"{ev}{p}; {runs_text(c['runs'])} ({per} per run) x {_units(c)}"
    return f"{ev}, one run each x {_units(c)} (fixed models)"


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
    """The comparisons table (CE in nats/token; sequences and documents beside each) and how it
    was computed, for a report's Markdown (a first column names the held-out text when an entry
    has ``"held_out"``)."""
    where = any(c.get("held_out") for c in comparisons)
    rows = [([c.get("held_out") or "in-domain"] if where else []) + [
        c["a"], c["b"], c.get("unit", SEQUENCE), c.get("runs", len(c["seeds"])), num(c["mean_diff"], "+.4f"),
        _ci(c["ci95"]), p_text(tested_p(c)), _ci(c.get("ci_holm")), p_text(c.get("p_adjusted")),
        f"**{c['verdict']}**" + (f" ({c['why']})" if c.get("why") and c["why"] != CONTAINS_ZERO else ""),
        ", ".join(num(x, "+.4f") for x in c["per_seed"]) if len(c["per_seed"]) > 1 else "—",
        num(c.get("seed_std"), ".4f"), num(c.get("icc"), ".2f"), c["sequences"],
        c["documents"] if c.get("documents") is not None else "none (independent)"] for c in comparisons]
    head = (["held-out text"] if where else []) + ["a", "b", "unit", "runs", "CE a − b", "95% CI (unadjusted)", "p",
                                                   "CI (Holm)", "p (Holm)", "verdict", "per run", "run std", "ICC",
                                                   "sequences", "documents"]
    independent = any(c.get("documents") is None for c in comparisons)
    return (table(head, rows) + "\n\n"
            "Method comparisons (unit **run**: arms trained with several seeds) estimate the difference between the "
            "methods on this kind of text: runs and documents are both samples, each variance component counted once "
            "(crossed runs x documents); a t interval over runs (runs − 1 degrees of freedom), p from that t test, "
            "Holm-adjusted over the report's method comparisons (the family); CI (Holm) is the interval at the level "
            "Holm tests that comparison at. One run per arm has no t test: its p reads — and its interval is the "
            f"sequence bootstrap of those two models. A verdict needs at least {MIN_RUNS} runs, an adjusted p below "
            "0.05 and "
            "every run's difference on the verdict's side. ICC: how strongly each sequence's difference repeats "
            "across runs. Fixed-model comparisons (unit **sequence**: one run of each) are a paired percentile "
            "bootstrap over held-out documents (each with its sequences) from a fixed seed, unadjusted; they describe "
            f"those two models, not a method. Any comparison over fewer than {MIN_DOCUMENTS} documents is not resolved. "
            + ("Where documents reads \"none\", the corpus records no document boundaries and the sequences were "
               "treated as independent. " if independent else "")
            + "\"not resolved\" means the data cannot tell the arms apart; its point estimate is still shown.")
