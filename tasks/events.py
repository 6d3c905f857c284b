"""What every ZeroGraph task does at the start and end of its run, in the process that runs it:
Luigi event handlers on :class:`tasks.base.ZGTask` (registered when the ``tasks`` package is imported)."""
from __future__ import annotations

import logging

import luigi

from zgcore.progress import quiet_library_bars
from zgcore.threads import apply_threads

from .base import ZGTask, zerograph


@ZGTask.event_handler(luigi.Event.START)
def _choose_threads(task: ZGTask) -> None:
    """At the start of every task's run, in the process that runs it: set torch's thread count
    (:func:`zgcore.threads.apply_threads`; what was chosen and why is an INFO line of Luigi's log,
    shown with ``--log-level INFO``) and turn Hugging Face's own progress bars off outside a terminal
    (:func:`zgcore.progress.quiet_library_bars`). A bad ``OMP_NUM_THREADS`` or ``[zerograph] threads``
    is said in one line and torch's count is left as it is."""
    quiet_library_bars()
    try:
        n, why = apply_threads(task.model_params(), zerograph().threads)
    except ValueError as e:
        import torch

        task.log(f"warning: {e}; torch keeps {torch.get_num_threads()} thread(s)")
        return
    logging.getLogger("luigi-interface").info(f"[{task.title()}] {n} torch thread(s) ({why})")


@ZGTask.event_handler(luigi.Event.PROCESSING_TIME)
def _say_done(task: ZGTask, seconds: float) -> None:
    """After a task's run succeeded, in the process that ran it: ``[<title>] done in <s> s`` when the task
    said nothing itself, so that every task that ran has a line (Luigi's own INFO lines are off by default)."""
    if not getattr(task, "_said", False):
        task.log(f"done in {seconds:.1f} s")


@ZGTask.event_handler(luigi.Event.START)
def _remove_leftovers(task: ZGTask) -> None:
    """At the start of every task's run: remove what its dead writers left (:meth:`ZGTask.remove_leftovers`)."""
    task.remove_leftovers()
