"""The exact choice of one candidate block per partition under a budget: a multiple-choice knapsack
solved as a mixed-integer linear programme (``scipy.optimize.milp``, HiGHS branch and bound).

Minimise the summed in-context cross-entropy increase ``sum_i sum_v d[i][v] x[i][v]`` over binary
``x`` subject to ``sum_v x[i][v] = 1`` for every partition ``i`` (one variant each) and
``sum_i sum_v c[i][v] x[i][v] <= budget``. The cost of the whole student is the summed cost of its
blocks plus a constant (the final norm's parameters for a parameter budget), which the caller
folds into the budget.

Follows Bercovich et al. 2024, "Puzzle: Distillation-Based NAS for Inference-Optimized LLMs"
(arXiv:2411.19146), section 4 (mixed-integer programming over a library of block variants).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from zgcore.checks import ConfigError


def smallest_cost(costs: Sequence[Sequence[float]]) -> float:
    """The cheapest student's summed cost: each partition's cheapest variant (same unit as ``costs``)."""
    return float(sum(min(c) for c in costs))


def check_feasible(costs: Sequence[Sequence[float]], budget: float, what: str, unit: str) -> None:
    """Raise :class:`ConfigError` when no choice fits ``budget``, naming the smallest feasible budget.

    Args:
        costs: ``costs[i][v]``: cost of variant ``v`` at partition ``i`` (block costs plus the
            student's constant share, see the module docstring).
        budget: the budget in the same unit. what: how the user wrote it (e.g. ``library.budgets[0]=0.5``).
        unit: the unit's name for the message (``params``, ``flops``, ``kv_bytes``).
    """
    low = smallest_cost(costs)
    if budget < low:
        raise ConfigError(f"{what} is {budget:,.0f} {unit}, below the smallest student the library can build "
                          f"({low:,.0f} {unit}, each partition's cheapest variant): raise it to at least {low:,.0f}")


def select(deltas: Sequence[Sequence[float]], costs: Sequence[Sequence[float]], budget: float) -> dict:
    """The exact multiple-choice knapsack choice.

    Args:
        deltas: ``deltas[i][v]``: CE increase (nats/token, float) of variant ``v`` at partition ``i``
            (partitions may have different numbers of variants).
        costs: ``costs[i][v]``: its cost (params, FLOPs/token or KV bytes/token), same shape.
        budget: the most the chosen variants' summed cost may be (same unit).

    Returns:
        ``{"chosen": [variant index per partition], "delta": summed CE increase, "cost": summed cost}``.
        Among equal-CE optima the solver's pick is returned; ties are not broken further.

    Raises:
        ValueError: shapes differ, a value is not finite, or no choice fits (``check_feasible``
            says so in configuration terms before anything runs).
        RuntimeError: the solver fails on a feasible problem.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    if len(deltas) != len(costs) or any(len(d) != len(c) for d, c in zip(deltas, costs)):
        raise ValueError("select: deltas and costs need one entry per partition and variant")
    d = np.concatenate([np.asarray(x, dtype=np.float64) for x in deltas])
    c = np.concatenate([np.asarray(x, dtype=np.float64) for x in costs])
    if not (np.isfinite(d).all() and np.isfinite(c).all()):
        raise ValueError("select: a CE increase or cost is not finite")
    if budget < smallest_cost(costs):
        raise ValueError(f"select: budget {budget} is below the smallest student's {smallest_cost(costs)}")
    sizes = [len(x) for x in deltas]
    one_each = np.zeros((len(sizes), len(d)))
    lo = 0
    for i, n in enumerate(sizes):
        one_each[i, lo: lo + n] = 1
        lo += n
    scale = max(1.0, float(np.abs(c).max()))  # costs of ~1e8 params: solve in units of the largest
    # integral costs (parameters): half a unit of slack below the budget keeps the solver's feasibility
    # tolerance from admitting a choice one parameter over it, and still admits one exactly at it
    rhs = (np.floor(budget) + 0.25 if np.all(c == np.round(c)) else budget) / scale
    cons = [LinearConstraint(one_each, 1, 1), LinearConstraint(c[None, :] / scale, -np.inf, rhs)]
    res = milp(d, constraints=cons, integrality=np.ones(len(d)), bounds=Bounds(0, 1))
    if res.x is None:
        raise RuntimeError(f"select: the MILP solver found no solution ({res.message})")
    x = np.round(res.x).astype(int)
    chosen, lo = [], 0
    for n in sizes:
        chosen.append(int(np.argmax(x[lo: lo + n])))
        lo += n
    total = float(sum(costs[i][v] for i, v in enumerate(chosen)))
    if total > budget * (1 + 1e-6):  # the solver's feasibility tolerance must not let a real overrun through
        raise RuntimeError(f"select: the solver's choice costs {total} > budget {budget}")
    return {"chosen": chosen, "delta": float(sum(deltas[i][v] for i, v in enumerate(chosen))), "cost": total}


def brute_force(deltas: Sequence[Sequence[float]], costs: Sequence[Sequence[float]], budget: float) -> dict:
    """:func:`select` by enumerating every combination (``prod(len(d))`` of them): the reference the
    tests check the solver against, usable only on small libraries. Same return value."""
    best = None
    for combo in itertools.product(*[range(len(x)) for x in deltas]):
        cost = sum(costs[i][v] for i, v in enumerate(combo))
        if cost > budget:
            continue
        delta = sum(deltas[i][v] for i, v in enumerate(combo))
        if best is None or delta < best["delta"]:
            best = {"chosen": list(combo), "delta": float(delta), "cost": float(cost)}
    if best is None:
        raise ValueError(f"brute_force: no combination fits budget {budget}")
    return best
