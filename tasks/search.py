"""The learning-rate search in the Luigi graph (issue 19): every candidate lr is its own task,
and each round after the first is known only once the previous one is scored, so the tasks that
search (``ChooseLocalLR``, a ``DistillE2E`` or ``TrainBlock`` with ``lrs``) ``yield`` the rounds
as dynamic dependencies. The candidate logic itself is :mod:`zgcore.lr_search`.

A candidate task's output is either a trained run or, when its training diverged
(:class:`zgcore.loop.NonFiniteError`), only ``diverged.json`` (:data:`DIVERGED`): the search
records it, it loses, and the search goes on.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from zgcore import lr_search
from zgcore.atomic import write_json

DIVERGED = "diverged.json"  # the whole output of a search candidate whose training diverged


def diverged(task) -> dict | None:
    """The divergence record of a finished training task (``{"lr", "step", "what", "value",
    "message"}``), or ``None`` when it trained to the end."""
    path = Path(task.out_dir) / DIVERGED
    return json.loads(path.read_text()) if path.exists() else None


def record_divergence(task, lr: float, err) -> None:
    """Complete ``task`` with only ``diverged.json`` (lr and :meth:`NonFiniteError.record`) and
    drop its work folder: a candidate's divergence is its result."""
    with task.building() as tmp:
        write_json(tmp / DIVERGED, {"lr": float(lr), **err.record()})
    if hasattr(task, "drop_work"):
        task.drop_work()
    task.log(f"diverged at lr {float(lr):g}: {err.what} is {err.value} at step {err.step}; the search goes on without it")


def replay(grid: Sequence[float], rounds: int, make: Callable[[float], Any], score: Callable[[Any], dict]):
    """Replay a search over the candidate tasks that exist.

    Args:
        grid: the first round's lrs. rounds: rounds at most.
        make: ``make(lr)`` → the task that scores the candidate at ``lr``.
        score: ``score(task)`` of a complete task → ``{"score": float | None, "diverged": dict | None, ...}``.

    Returns:
        ``(rounds_done, results, tasks, pending)``: ``{lr: score dict}`` of every finished
        candidate, their tasks in search order, and the next round's tasks ([] when the search is over).
    """
    results, tasks, n = {}, [], 0
    todo = sorted(float(x) for x in grid)
    while todo and n < int(rounds):
        batch = [make(lr) for lr in todo]
        if not all(t.complete() for t in batch):
            return n, results, tasks, batch
        n += 1
        for lr, t in zip(todo, batch):
            results[lr] = score(t)
        tasks += batch
        todo = lr_search.next_lrs({lr: r["score"] for lr, r in results.items()})
    return n, results, tasks, []


def run_search(grid: Sequence[float], rounds: int, make: Callable[[float], Any], score: Callable[[Any], dict],
               who: str, hint: str) -> Iterator[list]:
    """Generator for a task's ``run``: ``yield``s each pending round, then returns (``StopIteration``
    value, so ``s, tasks = yield from run_search(...)``) :func:`zgcore.lr_search.summary` plus
    ``"results"`` and the candidate tasks.

    Raises:
        ValueError: every candidate diverged — ``"<who>: every learning rate of [...] diverged ...; <hint>"``.
    """
    while True:
        n, results, tasks, pending = replay(grid, rounds, make, score)
        if not pending:
            break
        yield pending
    div = {lr: r["diverged"] for lr, r in results.items() if r.get("diverged")}
    try:
        s = lr_search.summary({lr: r["score"] for lr, r in results.items()}, n, int(rounds), diverged=div)
    except ValueError as e:
        raise ValueError(f"{who}: {e}; {hint}") from None
    s["grid"] = sorted(float(x) for x in grid)
    return {**s, "results": results}, tasks


def tune_rows(n_val: int, tune, who: str):
    """The validation rows an lr search scores its candidates on: :func:`zgcore.metrics.tune_subset`
    of the test subset's settings ``tune`` (``{"max_sequences", "subset_seed"}``, the eval section
    or a block's ``train.tune``), int64 ``[rows]``. Raises ``ValueError`` naming ``who`` and what to
    set when the test subset takes every validation sequence."""
    from zgcore.metrics import tune_subset

    return tune_subset(int(n_val), int(tune.get("max_sequences", 0)), int(tune.get("subset_seed", 0)), who)


def copy_output(src: Path, dst: Path, names: Sequence[str]) -> None:
    """Copy the files or folders ``names`` of a finished candidate's output ``src`` into the
    output being built at ``dst`` (the searching task's result is its chosen candidate's)."""
    for name in names:
        a = Path(src) / name
        if a.is_dir():
            shutil.copytree(a, Path(dst) / name)
        elif a.exists():
            shutil.copy2(a, Path(dst) / name)


def search_record(s: dict, tasks: Sequence[Any]) -> dict:
    """``search.json`` of a searching task: the summary without the per-candidate details, and
    each candidate's folder."""
    keep = ("grid", "lrs", "scores", "best_lr", "at_edge", "converged", "rounds", "max_rounds", "diverged")
    return {**{k: s[k] for k in keep}, "candidates": [str(t.out_dir) for t in tasks]}
