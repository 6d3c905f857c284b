"""The variance estimators behind :func:`zgcore.evaluation.compare.compare` (numpy only).

A comparison's data are the paired differences ``d[s, i] = CE_a[s, i] - CE_b[s, i]`` (nats/token)
of ``R`` training runs ``s`` on the same ``n`` held-out sequences ``i``, the sequences grouped in
documents (clusters). The model is crossed random effects: ``d[s, i] = mu + a_s + u_i + e_si``
with a run effect ``a_s`` (variance ``sigma_a^2``), a sequence/document effect ``u_i`` shared by
every run (``sigma_u^2``; correlated within a document) and a residual ``e_si`` (``sigma_e^2``).
The estimand is ``mu``: the difference between the methods on this kind of text, so both the runs
and the documents are samples, and the variance of the grand mean is
``sigma_a^2 / R + sigma_u^2 / n + sigma_e^2 / (R n)`` (document-clustered).

Sources: Searle, Casella & McCulloch, *Variance Components* (1992), method of moments for crossed
random effects; the cluster-robust variance of a mean (Cameron & Miller, J. Human Resources 2015);
the cluster bootstrap (Field & Welsh, JRSS B 2007); McGraw & Wong, Psychol. Methods 1996 (ICC).
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

BATCH = 250  # bootstrap resamples drawn at once: bounds memory (BATCH x clusters); fixed, as it orders the draws


def clusters(n: int, groups: Sequence[int] | None) -> np.ndarray:
    """``[n]`` int cluster index (0..G-1) of each sequence: its document, or itself without ``groups``.

    Raises:
        ValueError: ``groups`` is not ``[n]``."""
    if groups is None:
        return np.arange(n)
    g = np.asarray(groups)
    if g.shape != (n,):
        raise ValueError(f"groups: {g.shape[0] if g.ndim else 0} document ids for {n} sequences")
    return np.unique(g, return_inverse=True)[1].reshape(-1)


def within_variance(d: np.ndarray, cl: np.ndarray) -> float:
    """Variance of the mean of ``d`` ``[n]`` over sequences, clustered: with ``G`` clusters
    (``cl``: ``[n]`` cluster index) and residual sums ``E_g``, ``G / (G - 1) x sum_g E_g^2 / n^2``
    (the cluster-robust variance of a mean; each sequence its own cluster gives ``var(d) / n``).
    ``inf`` with fewer than 2 clusters."""
    n, g = len(d), int(cl.max()) + 1
    if g < 2:
        return float("inf")
    e = np.bincount(cl, weights=d - d.mean(), minlength=g)
    return float(g / (g - 1) * (e ** 2).sum() / n ** 2)


def crossed_variance(diffs: np.ndarray, cl: np.ndarray) -> tuple[float, dict[str, float]]:
    """Variance of the grand mean of ``diffs`` (``[R, n]`` float, ``R >= 2`` runs) under crossed
    run and document effects, each component counted once (method of moments):

    ``se^2 = var_s(d_s) / R + max(0, (R V - mean_s v_s) / (R - 1))``

    with ``d_s`` run ``s``'s mean difference, ``v_s`` its document-clustered within-run variance
    (:func:`within_variance`), and ``V`` the document-clustered variance of the mean of
    ``dbar_i`` (each sequence's difference averaged over runs). ``var_s(d_s) / R`` estimates
    ``sigma_a^2 / R + sigma_e^2 / (R n)``; ``(R V - mean v) / (R - 1)`` estimates the shared term
    ``sigma_u^2 / n``. Equivalent to a two-way bootstrap that resamples runs and documents
    independently (the same document draw for every run).

    Returns:
        ``(se^2, parts)`` with parts ``{"between_runs": var_s(d_s) / R, "shared": the second term,
        "within_runs": mean_s v_s}`` (nats/token squared); ``inf`` with fewer than 2 clusters.
    """
    r = diffs.shape[0]
    per_run = diffs.mean(axis=1)
    between = statistics.variance(per_run.tolist()) / r
    v_bar = within_variance(diffs.mean(axis=0), cl)
    v_runs = float(np.mean([within_variance(d, cl) for d in diffs]))
    if not np.isfinite(v_bar):
        return float("inf"), {"between_runs": between, "shared": float("inf"), "within_runs": v_runs}
    shared = max(0.0, (r * v_bar - v_runs) / (r - 1))
    return between + shared, {"between_runs": between, "shared": shared, "within_runs": v_runs}


def icc(diffs: np.ndarray) -> float | None:
    """Intraclass correlation of ``d[s, i]`` (``[R, n]``) across runs: the share of the
    per-sequence variance of the difference that repeats in every run (ICC(3,1), consistency,
    two-way mixed, McGraw & Wong 1996), ``(MS_seq - MS_err) / (MS_seq + (R - 1) MS_err)``.
    Near 1: each sequence's difference is the same in every run (a shared effect the runs cannot
    average away); near 0: it is fresh noise in each run. None for one run, one sequence or no
    variance at all."""
    r, n = diffs.shape
    if r < 2 or n < 2:
        return None
    c = diffs - diffs.mean(axis=1, keepdims=True)  # run effects removed
    seq = c.mean(axis=0)
    ms_seq = r * float((seq ** 2).sum()) / (n - 1)
    ms_err = float(((c - seq) ** 2).sum()) / ((n - 1) * (r - 1))
    den = ms_seq + (r - 1) * ms_err
    return None if den <= 0 else (ms_seq - ms_err) / den


def bootstrap(d: np.ndarray, cl: np.ndarray, resamples: int, rng_seed: int, level: float) -> tuple[float, float, float]:
    """Percentile interval at ``level`` and two-sided bootstrap p of the mean of ``d`` ``[n]``,
    resampling clusters (``cl``: ``[n]`` cluster index) with replacement, ``resamples`` times from
    ``numpy.random.default_rng(rng_seed)``: ``(lo, hi, p)``."""
    g = int(cl.max()) + 1
    sums, counts = np.bincount(cl, weights=d, minlength=g), np.bincount(cl, minlength=g).astype(np.float64)
    rng, stats = np.random.default_rng(int(rng_seed)), []
    for lo in range(0, int(resamples), BATCH):
        pick = rng.integers(0, g, size=(min(BATCH, int(resamples) - lo), g))
        stats.append(sums[pick].sum(axis=1) / counts[pick].sum(axis=1))
    s = np.concatenate(stats)
    a = (1 - level) / 2
    p = min(1.0, 2 * min(float((s <= 0).mean()), float((s >= 0).mean())))
    return float(np.quantile(s, a)), float(np.quantile(s, 1 - a)), p
