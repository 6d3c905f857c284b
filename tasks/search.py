"""The learning-rate search in the Luigi graph: every candidate lr is its own task,
and each round after the first is known only once the previous one is scored, so the tasks that
search (``ChooseLocalLR``, a ``DistillE2E`` or ``TrainBlock`` with ``lrs``) ``yield`` the rounds
as dynamic dependencies. The candidate logic itself is :mod:`zgcore.training.lr_search`.

A candidate task's output is either a trained run or, when its training diverged
(:class:`zgcore.training.loop.NonFiniteError`), only ``diverged.json`` (:data:`DIVERGED`): the search
records it, it loses, and the search goes on.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Sequence

from zgcore.atomic import write_json
from zgcore.training import lr_search
from zgcore.training.loop import NonFiniteError

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
    value, so ``s, tasks = yield from run_search(...)``) :func:`zgcore.training.lr_search.summary` plus
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
    """The validation rows an lr search scores its candidates on: :func:`zgcore.evaluation.metrics.tune_subset`
    of the test subset's settings ``tune`` (``{"max_sequences", "subset_seed"}``, the eval section
    or a block's ``train.tune``), int64 ``[rows]``. Raises ``ValueError`` naming ``who`` and what to
    set when the test subset takes every validation sequence."""
    from zgcore.evaluation.metrics import tune_subset

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


class LRSearch:
    """The lr search of a training task whose peak lr may be searched (``TrainBlock`` with
    ``train.lrs``, ``DistillE2E`` with ``distill.lrs``), composed into the task: the task's ``run``
    is ``yield from LRSearch(self, section).run(self.train_once)``.

    With ``lrs`` set in the task's ``section`` parameter, :meth:`run` searches: every candidate lr
    is its own task (the task's ``candidate_task(lr)``), scored by another (``score_task(candidate)``,
    ``score_of(score task)`` -> ``{"score", "diverged"}``), rounds ``yield``ed as dynamic dependencies,
    after ``check_tune_rows()`` (raises when no validation sequence lies outside the test subset);
    then the task writes its output from the chosen candidate (``keep_chosen(best, tmp, summary,
    record)``); ``search_hint()`` (if it has one) says what to change when every candidate diverged. Without
    ``lrs`` it trains once, and a search candidate (``task.candidate``) that diverges completes with
    only ``diverged.json``.
    """

    def __init__(self, task, section: str = "train"):
        self.task, self.section = task, section

    @property
    def settings(self):
        """The mapping with ``lr``, ``lrs`` and ``lr_rounds`` (the task's ``section`` parameter)."""
        return getattr(self.task, self.section)

    @property
    def active(self) -> bool:
        """Whether the task searches (``lrs`` is set)."""
        return bool(self.settings.get("lrs"))

    def _search(self):
        def make(lr):
            return self.task.score_task(self.task.candidate_task(lr))
        sec = self.settings
        return [float(x) for x in sec["lrs"]], int(sec["lr_rounds"]), make, self.task.score_of

    def dynamic_upstream(self) -> list:
        """With a search: every candidate's score that exists (read like static inputs)."""
        return replay(*self._search())[2] if self.active else []

    def run(self, train_once: Callable[[], None]):
        """Generator for the task's ``run``: ``train_once()``; with ``lrs``, search the lr instead and keep
        a copy of the chosen candidate's output plus ``search.json``. A candidate whose training diverges
        (:class:`~zgcore.training.loop.NonFiniteError`) writes only ``diverged.json``."""
        task = self.task
        if not self.active:
            try:
                train_once()
            except NonFiniteError as e:
                if not task.candidate:
                    raise
                record_divergence(task, self.settings["lr"], e)
            return
        task.check_tune_rows()
        hint = task.search_hint() if hasattr(task, "search_hint") else f"lower {self.section}.lrs"
        s, tasks = yield from run_search(*self._search(), who=task.title(), hint=hint)
        with task.building() as tmp:
            task.keep_chosen(task.candidate_task(s["best_lr"]), tmp, s, search_record(s, tasks))
        task.log(f"chosen lr {s['best_lr']:g} ({lr_search.edge_note(s)}) of " + ", ".join(
            f"{lr:g}: {'diverged' if v is None else f'{v:.4f}'}" for lr, v in zip(s["lrs"], s["scores"])))
