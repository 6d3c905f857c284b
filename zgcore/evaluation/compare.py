"""Comparisons between arms of a study: a paired bootstrap interval on the difference of held-out
cross-entropy, pooled over seeds, and the verdict it supports.

Every study report (objective study, seeds, distillation study, local-learning study) compares
pairs of arms through :func:`compare` and writes its findings with :func:`sentence`, so no report
declares a finding its evidence does not support.

Method: both arms are scored on the same held-out sequences (the same rows, in the same order:
:func:`zgcore.evaluation.metrics.test_subset` picks them, and :func:`check_same_sequences` checks their
digest). Per sequence, the mean next-token CE (nats/token) of each arm; per seed ``s`` and sequence
``i`` the difference ``d[s, i] = CE_a[s, i] - CE_b[s, i]``. The statistic is the mean of ``d`` over
sequences, averaged over seeds. Its 95% interval is a percentile bootstrap over sequences
(``scipy.stats.bootstrap`` with ``paired=True``: every resample draws the same sequence indices
for every seed and both arms), with :data:`RESAMPLES` resamples from a fixed seed, so a report is
reproducible to the byte. The verdict is ``"a better"`` when the whole interval lies below 0 (a's
CE is lower), ``"b better"`` when it lies above 0, else ``"not resolved"``. The bootstrap treats
the seeds as fixed (sequences, not training runs, are what it resamples), so with several seeds a
verdict also needs every seed's own mean difference on the interval's side of 0: when the seeds
disagree in sign, the training runs' spread decides the sign and the comparison is "not resolved"
however narrow the pooled interval (``why`` says which rule held it back). Their spread is reported
beside it (each seed's own mean difference and their sample standard deviation).

Source: the paired bootstrap for comparing two systems on one test set (Koehn, EMNLP 2004;
Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993).
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
BATCH = 250  # resamples drawn at once: bounds memory (BATCH x seeds x sequences floats); fixed, as it orders the draws
A_BETTER, B_BETTER, NOT_RESOLVED = "a better", "b better", "not resolved"
CONTAINS_ZERO, SEEDS_DISAGREE = "the interval contains 0", "the seeds disagree in sign"  # why "not resolved"
SCORES = "per_sequence_ce.json"  # every evaluation's per-sequence CE (nats/token), beside its summary


def subset_digest(indices: np.ndarray) -> str:
    """SHA-256 (hex) of held-out row indices as little-endian int64: names the exact sequences an
    evaluation scored, so two arms can be checked to have scored the same ones."""
    return hashlib.sha256(np.ascontiguousarray(indices, dtype="<i8").tobytes()).hexdigest()


def scores_part(scores: Mapping[str, np.ndarray], indices: np.ndarray) -> dict[str, Any]:
    """Per-sequence CE of the models scored on one held-out set, as JSON-ready lists.

    Args:
        scores: model key -> ``[n]`` per-sequence mean CE (nats/token), every array as long as ``indices``.
        indices: ``[n]`` int rows of the held-out set that were scored, in scoring order.

    Returns:
        ``{"rows": [n ints], "subset_sha256", "sequences", "ce": {key: [n floats]}}``.

    Raises:
        ValueError: an array of another length than ``indices`` or with a non-finite value.
    """
    out = {"rows": [int(i) for i in indices], "subset_sha256": subset_digest(np.asarray(indices)),
           "sequences": int(len(indices)), "ce": {}}
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
    """Read a :func:`save_scores` file, every ``ce`` list as a float64 ``np.ndarray``."""
    d = json.loads(Path(path).read_text())
    for part in [d["val"], *d.get("extra", {}).values()]:
        part["ce"] = {k: np.asarray(v, dtype=np.float64) for k, v in part["ce"].items()}
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


def compare(a: str, b: str, ce_a: Sequence[np.ndarray], ce_b: Sequence[np.ndarray], seeds: Sequence[int],
            resamples: int = RESAMPLES, rng_seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """Compare arm ``a`` with arm ``b`` on paired per-sequence held-out CE, pooled over seeds.

    Args:
        a, b: the arms' names (as the report calls them).
        ce_a, ce_b: one ``[n]`` array per seed (same order as ``seeds``) of per-sequence mean CE
            (nats/token), float; ``ce_a[s][i]`` and ``ce_b[s][i]`` score the same sequence ``i``,
            and every seed scores the same ``n`` sequences.
        seeds: the seeds the arrays belong to (one per array).
        resamples: bootstrap resamples. rng_seed: seed of the bootstrap's generator.

    Returns:
        ``{"a", "b", "mean_diff" (CE a minus CE b, nats/token, averaged over sequences and seeds),
        "ci95": [lo, hi], "seeds" (list), "sequences" (n per seed), "verdict", "why" (for "not
        resolved": "the interval contains 0" or "the seeds disagree in sign"; else None),
        "per_seed" (each seed's mean difference), "seed_std" (their sample std; None for one
        seed), "resamples", "method"}``.

    Raises:
        ValueError: no seed, arrays of different lengths, fewer than 2 sequences, or a non-finite CE.
    """
    from scipy.stats import bootstrap

    if not seeds or len(ce_a) != len(seeds) or len(ce_b) != len(seeds):
        raise ValueError(f"compare({a!r}, {b!r}) needs one CE array per seed for each arm: "
                         f"{len(ce_a)} and {len(ce_b)} arrays for seeds {list(seeds)}")
    n = len(ce_a[0])
    if any(np.shape(x) != (n,) for x in (*ce_a, *ce_b)):
        raise ValueError(f"compare({a!r}, {b!r}): every arm and seed must score the same number of sequences")
    diffs = [np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64) for x, y in zip(ce_a, ce_b)]
    if n < 2:
        raise ValueError(f"compare({a!r}, {b!r}): a bootstrap needs at least 2 held-out sequences, got {n}")
    if not all(np.isfinite(d).all() for d in diffs):
        raise ValueError(f"compare({a!r}, {b!r}): a per-sequence CE is not finite")
    per_seed = [float(d.mean()) for d in diffs]
    mean = float(np.mean(per_seed))
    if all(np.ptp(d) == 0 for d in diffs):  # no spread at all (e.g. the same run twice): the interval is the point
        lo = hi = mean
    else:
        res = bootstrap(tuple(diffs), lambda *d, axis=-1: np.mean([x.mean(axis=axis) for x in d], axis=0),
                        n_resamples=int(resamples), paired=True, vectorized=True, confidence_level=LEVEL,
                        batch=BATCH, method="percentile", rng=np.random.default_rng(int(rng_seed)))
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    v, why = verdict(lo, hi), None
    if v == NOT_RESOLVED:
        why = CONTAINS_ZERO
    elif len(per_seed) > 1 and not all((d < 0) if v == A_BETTER else (d > 0) for d in per_seed):
        v, why = NOT_RESOLVED, SEEDS_DISAGREE
    return {"a": a, "b": b, "mean_diff": mean, "ci95": [lo, hi], "seeds": [int(s) for s in seeds], "sequences": int(n),
            "verdict": v, "why": why, "per_seed": per_seed,
            "seed_std": statistics.stdev(per_seed) if len(per_seed) > 1 else None, "resamples": int(resamples),
            "method": "paired percentile bootstrap over held-out sequences (scipy.stats.bootstrap), pooled over seeds"}


def compare_arms(pairs: Sequence[tuple[str, str]], arms: Mapping[str, Mapping[int, np.ndarray]]) -> list[dict[str, Any]]:
    """:func:`compare` for each ``(a, b)`` of ``pairs`` whose two arms were both measured, pooled
    over the seeds both have (ascending).

    Args:
        pairs: arm-name pairs, in the order the report lists them.
        arms: arm name -> {seed: per-sequence CE ``[n]`` (nats/token)}, every array over the same sequences.

    Returns:
        The comparisons, skipping pairs with an unmeasured arm or no common seed.
    """
    out = []
    for a, b in pairs:
        if a not in arms or b not in arms:
            continue
        seeds = sorted(set(arms[a]) & set(arms[b]))
        if seeds:
            out.append(compare(a, b, [arms[a][s] for s in seeds], [arms[b][s] for s in seeds], seeds))
    return out


def sentence(c: Mapping[str, Any]) -> str:
    """The one sentence a report may write about comparison ``c`` (:func:`compare`): which arm has
    the lower held-out CE and by how much, or that the comparison is not resolved."""
    lo, hi = c["ci95"]
    ev = (f"{num(c['mean_diff'], '+.4f')} nats/token, 95% CI [{num(lo, '+.4f')}, {num(hi, '+.4f')}], "
          f"{len(c['seeds'])} seed(s) x {c['sequences']} sequences")
    if c["verdict"] == A_BETTER:
        return f"{c['a']} beats {c['b']} (CE difference {ev})"
    if c["verdict"] == B_BETTER:
        return f"{c['b']} beats {c['a']} (CE difference {c['a']} minus {c['b']} {ev})"
    if c.get("why") == SEEDS_DISAGREE:
        seeds = ", ".join(num(x, "+.4f") for x in c["per_seed"])
        return f"{c['a']} vs {c['b']}: not resolved (the seeds disagree in sign: {seeds} per seed; pooled {ev})"
    return f"{c['a']} vs {c['b']}: not resolved (the interval contains 0: {ev})"


def markdown(comparisons: Sequence[Mapping[str, Any]]) -> str:
    """The comparisons table (CE in nats/token) and how it was computed, for a report's Markdown
    (a first column names the held-out text when an entry has ``"held_out"``)."""
    where = any(c.get("held_out") for c in comparisons)
    rows = [([c.get("held_out") or "in-domain"] if where else []) + [c["a"], c["b"], num(c["mean_diff"], "+.4f"), f"[{num(c['ci95'][0], '+.4f')}, {num(c['ci95'][1], '+.4f')}]",
             len(c["seeds"]), c["sequences"], f"**{c['verdict']}**" + (" (seeds disagree)" if c.get("why") == SEEDS_DISAGREE else ""),
             ", ".join(num(x, "+.4f") for x in c["per_seed"]) if len(c["per_seed"]) > 1 else "—",
             num(c.get("seed_std"), ".4f")] for c in comparisons]
    head = (["held-out text"] if where else []) + ["a", "b", "CE a − b", "95% CI", "seeds", "sequences", "verdict", "per seed", "seed std"]
    n = comparisons[0]["resamples"] if comparisons else RESAMPLES
    return (table(head, rows) + "\n\nPaired bootstrap over held-out sequences (both arms scored on the same "
            f"sequences; {n} resamples from a fixed seed; pooled over seeds). A verdict needs the whole 95% interval "
            "on one side of 0 and, with several seeds, every seed's own difference on that side; \"not resolved\" "
            "means the data cannot tell the arms apart (\"seeds disagree\": the pooled interval excludes 0 but the "
            "training runs do not agree on the sign). \"seed std\" is the seed-to-seed spread of the difference, "
            "which the interval does not include.")
