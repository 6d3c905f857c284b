"""Peak resident memory of every task family on one teacher, one process: run as
``python -m tests.memory_probe <teacher folder> <outputs> <graph> ...`` (graphs: keys of :data:`GRAPHS`) and print ``{family: peak MiB}`` as JSON on the last line.

Each task's figure is its own: the kernel's peak (``VmHWM``) is reset when the task starts
(:class:`zgcore.training.memory.PeakRSS`) and read when it ends; the tasks run one at a time in
this process (local scheduler, one worker). Run it with ``MALLOC_MMAP_THRESHOLD_`` set low, so that
what a task frees is handed back to the kernel before the next one starts.
"""
from __future__ import annotations

import json
import sys

import luigi

import workflows
from tasks.base import ZGTask
from zgcore.training.memory import PeakRSS

PEAKS: dict[str, float] = {}


@luigi.Task.event_handler(luigi.Event.START)
def _start(task):
    if isinstance(task, ZGTask):
        task._zg_peak = PeakRSS().start()


@luigi.Task.event_handler(luigi.Event.SUCCESS)
def _stop(task):
    if isinstance(task, ZGTask) and hasattr(task, "_zg_peak"):
        f = task.get_task_family()
        PEAKS[f] = max(PEAKS.get(f, 0.0), task._zg_peak.stop())


# the graphs measured, small: every model-touching family of the tiny experiment and of healing from the logit store
GRAPHS = {
    "tiny": ("RunExperiment", "tiny", ("corpus.max_tokens=2048 train.max_steps=2 eval.max_sequences=4 "
                                       "eval.context_sequences=1")),
    "heal_topk_tiny": ("RunExperiment", "heal_topk_tiny", ("corpus.max_tokens=2048 train.max_steps=2 heal.steps=1 "
                                                           "eval.max_sequences=4 eval.context_sequences=1")),
}


def main(teacher: str, outputs: str, graphs: list[str]) -> None:
    for g in graphs:
        cls, preset, over = GRAPHS[g]
        root = getattr(workflows, cls)(preset=preset, set=f"{over} teacher={teacher} teacher_stream=true",
                                       outputs=outputs)
        assert luigi.build([root], local_scheduler=True, workers=1, log_level="WARNING"), g
    print(json.dumps(PEAKS))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
