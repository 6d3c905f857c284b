"""The Make promise, measured: after an experiment is built, change one block's learning rate and
time the rebuild, divided by that block's TrainBlock in the same rebuild. Only the block, Assemble,
the new student's scoring tasks and the Evaluate join should run, so the ratio is close to 1
(target <= 1.15); before scoring was split out of Evaluate it was about 2.7 on the default experiment.

    python bench/rebuild.py                      # the default experiment (builds it first unless --outputs has it)
    python bench/rebuild.py --preset tiny        # seconds-long smoke run of the same shape
    python bench/rebuild.py --outputs outputs    # reuse an outputs folder where the experiment is built

The rebuild's time is the wall time of ``luigi.build`` of the changed experiment (scheduling and
every task's completeness check included); the block's time is its TrainBlock's processing time as
Luigi measures it (``Event.PROCESSING_TIME``). The last line printed is ``rebuild ratio X``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import luigi  # noqa: E402

TIMES: list[tuple[str, str, float]] = []  # (family, label, seconds) of every task processed


@luigi.Task.event_handler(luigi.Event.PROCESSING_TIME)
def _timed(task, seconds):
    label = task.label() if hasattr(task, "label") else ""
    TIMES.append((task.get_task_family(), label, float(seconds)))


def build(preset: str, overrides: str, outputs: str) -> tuple[bool, float]:
    """Run the experiment ``preset`` with ``overrides`` into ``outputs`` (one worker, local
    scheduler); ``(ok, wall seconds)``."""
    from workflows import RunExperiment

    TIMES.clear()
    t0 = time.perf_counter()
    res = luigi.build([RunExperiment(preset=preset, set=overrides, outputs=outputs)], local_scheduler=True,
                      workers=1, log_level="WARNING", detailed_summary=True)
    return res.scheduling_succeeded and "failed" not in res.summary_text.lower().split("this progress looks")[0], \
        time.perf_counter() - t0


def block_lr(preset: str, block: int) -> float:
    """The resolved learning rate of block ``block`` in the preset."""
    from workflows.experiment import block_settings, load_config

    return float(block_settings(load_config(preset=preset))[block]["lr"])


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="default", help="experiment preset (default: default; tiny for a smoke run)")
    ap.add_argument("--outputs", default="", help="outputs folder (default: a temporary one, removed at the end)")
    ap.add_argument("--block", type=int, default=1, help="the block whose learning rate changes (default 1)")
    ap.add_argument("--factor", type=float, default=0.5, help="its new lr = factor x its current lr (default 0.5)")
    a = ap.parse_args(argv)
    tmp = None if a.outputs else tempfile.TemporaryDirectory(prefix="zg-rebuild-")
    outputs = a.outputs or tmp.name
    try:
        ok, first = build(a.preset, "", outputs)
        if not ok:
            raise SystemExit("the experiment failed to build; see the log above")
        print(f"experiment built in {first:.1f} s ({len(TIMES)} task(s) ran)", flush=True)
        lr = block_lr(a.preset, a.block) * a.factor
        ok, rebuild = build(a.preset, f"blocks.{a.block}.lr={lr:g}", outputs)
        if not ok:
            raise SystemExit("the rebuild failed; see the log above")
        ran = list(TIMES)
    finally:
        if tmp is not None:
            tmp.cleanup()
    for fam, label, s in ran:
        print(f"  {fam:<16} {label:<28} {s:8.2f} s", flush=True)
    block = [s for fam, label, s in ran if fam == "TrainBlock" and label.startswith(f"block{a.block}-")]
    if len(block) != 1:
        raise SystemExit(f"expected block {a.block}'s TrainBlock to run once in the rebuild, it ran {len(block)} time(s)")
    ratio = rebuild / block[0]
    print(f"rebuild {rebuild:.2f} s (blocks.{a.block}.lr={lr:g}); TrainBlock block {a.block} {block[0]:.2f} s")
    print(f"rebuild ratio {ratio:.3f}", flush=True)
    return ratio


if __name__ == "__main__":
    main()
