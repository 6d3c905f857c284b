"""The learning-rate search every tuned arm uses: start from a coarse grid of
peak learning rates, then, round by round, refine around the best one (geometric midpoints) and
extend past an edge of what was tried when the best one sits there, until the best is interior
and both its neighbours are at most ``max_ratio`` (2) times away, or a bounded number of rounds
is spent. A coarse grid can then no longer hide an optimum between or beyond its points.

Pure functions of the scores seen so far (no torch, no I/O): the tasks that train and score each
candidate (one task per lr) call :func:`next_lrs` to learn which candidates come next and
:func:`summary` for what a report states. A candidate whose run diverged
(:class:`zgcore.training.loop.NonFiniteError`) is scored ``None`` (or NaN): it loses to every finite score
and still counts as searched (it bounds the search from above).

The search follows common practice for tuning the peak lr of Adam-trained language models on a
log grid (e.g. the lr sweeps of "Training Compute-Optimal Large Language Models", Hoffmann et al.
2022, and of "Scaling Laws for Neural Language Models", Kaplan et al. 2020): loss is roughly
unimodal in log lr, so bracketing the minimum and halving the bracket in log space finds it.
"""
from __future__ import annotations

import math
from typing import Any
from collections.abc import Mapping, Sequence

MAX_RATIO = 2.0  # neighbours of the chosen lr are at most this factor away when the search converges
EXTEND_MAX = 4.0  # a step past an edge is the grid's own spacing there, at most this factor (at least MAX_RATIO)
_TOL = 1e-9


def _finite(score: Any) -> bool:
    """A real, finite score (Python or NumPy number; not a bool, not None)."""
    import numbers

    return isinstance(score, numbers.Real) and not isinstance(score, bool) and math.isfinite(float(score))


def _check(results: Mapping[float, Any]) -> list[float]:
    lrs = sorted(float(lr) for lr in results)
    if not lrs:
        raise ValueError("the lr search needs at least one learning rate")
    for lr in lrs:
        if not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"learning rates must be finite and > 0, got {lr!r}")
    return lrs


def choose_lr(lrs: Sequence[float], scores: Sequence[Any]) -> float:
    """The learning rate of lowest score (e.g. tuning CE, nats/token); a tie goes to the smaller
    lr. A diverged run (score ``None``, NaN or infinite) never wins.

    Raises:
        ValueError: different lengths, no lr, or no finite score at all (every candidate diverged).
    """
    if len(lrs) != len(scores) or not len(lrs):
        raise ValueError(f"choose_lr needs one score per lr, got {len(lrs)} lrs and {len(scores)} scores")
    finite = [(s, float(lr)) for lr, s in zip(lrs, scores) if _finite(s)]
    if not finite:
        raise ValueError(f"every learning rate of {sorted(float(x) for x in lrs)} diverged or gave no finite score")
    return min(finite)[1]


def round_lr(lr: float) -> float:
    """``lr`` rounded to 3 significant digits (new candidates read well in names and reports)."""
    return float(f"{lr:.3g}")


def next_lrs(results: Mapping[float, Any], max_ratio: float = MAX_RATIO, extend_max: float = EXTEND_MAX) -> list[float]:
    """The candidates of the next round, given every lr tried so far and its score (lower is
    better; ``None``/NaN = diverged); ``[]`` when the search has converged or cannot go on.

    With ``best`` the lowest finite score's lr and the tried lrs sorted:

    * ``best`` is the lowest lr tried: one step below it, ``best / f`` where ``f`` is the ratio to
      its upper neighbour clamped to ``[max_ratio, extend_max]`` (``extend_max`` alone when it is
      the only lr tried); else, when its lower neighbour is more than ``max_ratio`` below, their
      geometric midpoint;
    * the same above it (``best * f``, or the midpoint with the upper neighbour).

    New lrs are rounded to 3 significant digits (:func:`round_lr`). Converged: ``best`` is interior
    (a tried lr on each side, diverged ones included) and both neighbours are within ``max_ratio``.

    Args:
        results: ``{lr: score}``, lr > 0.
        max_ratio: > 1, the largest factor between the chosen lr and a neighbour at convergence.
        extend_max: >= ``max_ratio``, the largest step past an edge.

    Returns:
        New lrs, ascending, none already tried; ``[]`` also when no score is finite (every
        candidate diverged: the caller fails, see :func:`choose_lr`).

    Raises:
        ValueError: an lr that is not finite and positive, an empty ``results``, ``max_ratio <= 1``
            or ``extend_max < max_ratio``.
    """
    if not max_ratio > 1 or not extend_max >= max_ratio:
        raise ValueError(f"need max_ratio > 1 and extend_max >= max_ratio, got {max_ratio}, {extend_max}")
    lrs = _check(results)
    scores = {float(k): v for k, v in results.items()}
    if not any(_finite(scores[lr]) for lr in lrs):
        return []
    best = choose_lr(lrs, [scores[lr] for lr in lrs])
    i = lrs.index(best)
    new = []
    clamp = lambda r: min(max(r, max_ratio), extend_max)
    if i == 0:
        new.append(best / (clamp(lrs[1] / best) if len(lrs) > 1 else extend_max))
    elif best / lrs[i - 1] > max_ratio * (1 + _TOL):
        new.append(best / min(math.sqrt(best / lrs[i - 1]), extend_max))
    if i == len(lrs) - 1:
        new.append(best * (clamp(best / lrs[i - 1]) if len(lrs) > 1 else extend_max))
    elif lrs[i + 1] / best > max_ratio * (1 + _TOL):
        new.append(best * min(math.sqrt(lrs[i + 1] / best), extend_max))
    tried = set(lrs)
    return sorted({round_lr(x) for x in new} - tried)


def search(score, grid: Sequence[float], rounds: int, max_ratio: float = MAX_RATIO):
    """Run the whole search with a plain function (tests and simulations; the tasks drive rounds
    themselves as Luigi dynamic dependencies): ``score(lr) -> float | None``.

    Returns:
        ``(results, rounds_used)``: ``{lr: score}`` of every candidate tried, and rounds run.
    """
    results: dict[float, Any] = {}
    todo = sorted({float(x) for x in grid})
    used = 0
    while todo and used < rounds:
        used += 1
        for lr in todo:
            results[lr] = score(lr)
        todo = next_lrs(results, max_ratio)
    return results, used


def summary(results: Mapping[float, Any], rounds_used: int, max_rounds: int, max_ratio: float = MAX_RATIO,
            diverged: Mapping[float, Any] | None = None) -> dict[str, Any]:
    """What a report states about one arm's search.

    Args:
        results: ``{lr: score}`` of every candidate tried (``None`` = diverged).
        rounds_used, max_rounds: rounds run and the bound.
        diverged: optional ``{lr: {"step", "what"}}`` of the diverged candidates.

    Returns:
        ``{"lrs" (ascending), "scores" (one per lr, None when diverged), "best_lr", "at_edge"
        (the best is the lowest or highest lr tried), "converged" (no further candidate: interior
        with neighbours within ``max_ratio``), "rounds", "max_rounds", "diverged" ([{"lr", ...}])}``.

    Raises:
        ValueError: as :func:`choose_lr` (every candidate diverged).
    """
    lrs = _check(results)
    scores = [results[lr] if _finite(results[lr]) else None for lr in lrs]
    best = choose_lr(lrs, scores)
    div = [{"lr": lr, **dict((diverged or {}).get(lr) or {})} for lr, s in zip(lrs, scores) if s is None]
    return {"lrs": lrs, "scores": scores, "best_lr": best, "at_edge": best in (lrs[0], lrs[-1]) and len(lrs) > 1
            or len(lrs) == 1, "converged": not next_lrs(results, max_ratio), "rounds": int(rounds_used),
            "max_rounds": int(max_rounds), "diverged": div}


def edge_note(s: Mapping[str, Any]) -> str:
    """One phrase for a report: where the chosen lr sits in what :func:`summary` describes."""
    if s["at_edge"]:
        side = "lowest" if s["best_lr"] == s["lrs"][0] else "highest"
        return (f"at the {side} lr searched ({s['rounds']} of {s['max_rounds']} rounds): "
                "the optimum may lie beyond it")
    if not s["converged"]:
        return f"interior, but a neighbour is more than {MAX_RATIO:g}x away ({s['rounds']} of {s['max_rounds']} rounds)"
    return f"interior, neighbours within {MAX_RATIO:g}x"
