"""The plan of a run before it runs: for every task of a resolved graph its peak host and device
memory (weights, optimizer state, activations, buffers), the bytes it writes, its FLOPs and its
seconds on a stated device at a stated MFU; and the totals: the boundary store's size, the peak of
any task, the device-hours and the wall time with the graph's parallelism on ``devices`` devices
(its shards in parallel, its blocks in parallel).

It needs shapes only (:mod:`zgcore.evaluation.plan_shape`: a teacher's ``config.json``), never
weights. Each task's cost comes from :mod:`zgcore.evaluation.plan_costs` and
:mod:`zgcore.evaluation.plan_training` (:data:`FAMILIES`); the workflows hand in the
tasks (``workflows/plan.py`` walks the Luigi graph). Peaks come from
:mod:`zgcore.evaluation.accelerators`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from zgcore.evaluation import plan_costs as costs
from zgcore.evaluation import plan_training as training
from zgcore.evaluation.accelerators import Device
from zgcore.evaluation.plan_costs import READ_BPS, TASK_START_S, WRITE_BPS, Context, Cost

STORE_FAMILIES = ("BoundaryShard", "TeacherBoundary")  # the boundary store: its shards and their join


# every task family the registered workflows build, and its cost function (tests/test_plan.py walks their graphs)
FAMILIES: dict[str, Callable[[Mapping[str, Any], Context], Cost]] = {
    "PrepareTeacher": costs.prepare_teacher,
    "PrepareCorpus": costs.prepare_corpus,
    "PrepareHeldOut": costs.prepare_heldout,
    "BoundaryShard": costs.boundary_shard,
    "TeacherLogits": costs.logit_shard,
    "TeacherBoundary": costs.join,
    "TeacherLogitStore": costs.join,
    "TrainBlock": training.train_block,
    "ScoreBlock": costs.score_block,
    "Assemble": costs.assemble,
    "AssembleExact": costs.assemble,
    "ScoreTeacher": costs.score_teacher,
    "LayerImportance": costs.score_teacher,
    "ScoreUntrained": costs.score_student,
    "ScoreAssembled": costs.score_student,
    "ScoreStudent": costs.score_student,
    "ScoreCandidate": costs.score_student,
    "EvaluateStudent": costs.score_student,
    "BoundaryShift": costs.boundary_shift,
    "Heal": training.heal,
    "DistillE2E": training.heal,
    "PretrainLocal": training.pretrain_local,
    "EvaluateLocal": training.evaluate_local,
    **dict.fromkeys(
        (
            "Evaluate",
            "SeedSummary",
            "ObjectiveStudyReport",
            "DistillStudyReport",
            "DistillSeedsReport",
            "LibraryReport",
            "LocalStudyReport",
            "ChooseLocalLR",
            "SelectBudget",
        ),
        costs.report,
    ),
}


def task_cost(family: str, params: Mapping[str, Any], ctx: Context) -> Cost:
    """The :class:`Cost` of one task of ``family`` with Luigi parameters ``params``.

    Raises:
        KeyError: a family without a cost function in :data:`FAMILIES` (naming it)."""
    if family not in FAMILIES:
        raise KeyError(f"task family {family!r} has no cost model in zgcore.evaluation.plan.FAMILIES")
    return FAMILIES[family](params, ctx)


@dataclass
class TaskSpec:
    """One task to plan: ``id`` (unique), ``family``, ``name`` (what ``zerograph status`` prints),
    its Luigi ``params`` as plain JSON, the ids it depends on, whether it takes a device, and
    ``done`` (already built: it writes nothing more)."""

    id: str
    family: str
    name: str
    params: Mapping[str, Any]
    deps: Sequence[str] = ()
    uses_device: bool = True
    done: bool = False


@dataclass
class TaskPlan:
    """One task's predicted figures (bytes, FLOPs, seconds)."""

    id: str
    family: str
    name: str
    kind: str
    host: dict[str, int]
    device: dict[str, int]
    bytes_written: int
    scratch_bytes: int
    flops: int
    seconds: float
    uses_device: bool
    done: bool
    deps: Sequence[str] = field(default_factory=tuple)

    @property
    def host_bytes(self) -> int:
        """Peak resident host bytes (every part summed)."""
        return int(sum(self.host.values()))

    @property
    def device_bytes(self) -> int:
        """Peak device-memory bytes (0 on a CPU)."""
        return int(sum(self.device.values()))

    def record(self) -> dict[str, Any]:
        """The task as JSON (``zerograph plan --json``'s ``tasks`` entries)."""
        return {
            "family": self.family,
            "name": self.name,
            "kind": self.kind,
            "host_bytes": self.host_bytes,
            "device_bytes": self.device_bytes,
            "host": self.host,
            "device": self.device,
            "bytes_written": self.bytes_written,
            "scratch_bytes": self.scratch_bytes,
            "flops": self.flops,
            "seconds": self.seconds,
            "uses_device": self.uses_device,
            "done": self.done,
        }


def seconds_on(kind: str, flops: int, written: int, read: int, dev: Device) -> float:
    """Predicted seconds of one task on ``dev``: its FLOPs at the phase's MFU of the peak, plus its
    bytes written and read at the disk's rates, plus a task's start."""
    rate = dev.peak * dev.mfu.get("train" if kind == "train" else "forward", 0.4)
    return TASK_START_S + (flops / rate if flops else 0.0) + written / WRITE_BPS + read / READ_BPS


def plan_tasks(tasks: Sequence[TaskSpec], ctx: Context, dev: Device) -> list[TaskPlan]:
    """Each task's :class:`TaskPlan` on ``dev`` (``ctx.accelerator``: the model lives in device memory)."""
    out = []
    for t in tasks:
        c = task_cost(t.family, t.params, ctx)
        host, device = c.split(ctx.accelerator and t.uses_device)
        secs = seconds_on(c.kind, c.flops, c.bytes_written, c.read, dev)
        out.append(
            TaskPlan(
                t.id,
                t.family,
                t.name,
                c.kind,
                host,
                device,
                int(c.bytes_written),
                int(c.scratch),
                int(c.flops),
                float(secs),
                bool(t.uses_device),
                bool(t.done),
                tuple(t.deps),
            )
        )
    return out


def wall_seconds(plans: Sequence[TaskPlan], devices: int, workers: int | None = None) -> float:
    """The graph's wall time with ``devices`` devices: a list schedule in dependency order, each
    device task taking one free device as soon as its inputs are built (so shards run side by side,
    and blocks), host tasks (``uses_device`` false) taking one of ``workers`` host slots (default:
    as many as devices). Done tasks take no time."""
    devices, workers = max(1, int(devices)), max(1, int(workers or devices))
    by_id = {p.id: p for p in plans}
    finish: dict[str, float] = {}
    free = {True: [0.0] * devices, False: [0.0] * workers}
    for pool in free.values():
        heapq.heapify(pool)
    for p in plans:  # dependencies first (the walk's order)
        ready = max((finish[d] for d in p.deps if d in by_id), default=0.0)
        if p.done:
            finish[p.id] = ready
            continue
        pool = free[p.uses_device]
        start = max(ready, heapq.heappop(pool))
        finish[p.id] = start + p.seconds
        heapq.heappush(pool, finish[p.id])
    return max(finish.values(), default=0.0)


def totals(plans: Sequence[TaskPlan], devices: int = 1) -> dict[str, Any]:
    """The plan's totals: ``store_bytes`` (the boundary store: :data:`STORE_FAMILIES`),
    ``bytes_written`` (every task still to run), ``peak_host_bytes`` / ``peak_device_bytes`` (the
    largest task's, and which), ``flops``, ``device_hours`` (device tasks' seconds summed) and
    ``wall_seconds`` on ``devices`` devices."""
    todo = [p for p in plans if not p.done]
    host = max(plans, key=lambda p: p.host_bytes, default=None)
    dev = max(plans, key=lambda p: p.device_bytes, default=None)
    return {
        "store_bytes": int(sum(p.bytes_written for p in plans if p.family in STORE_FAMILIES)),
        "bytes_written": int(sum(p.bytes_written for p in todo)),
        "disk_needed_bytes": int(sum(p.bytes_written for p in todo) + max((p.scratch_bytes for p in todo), default=0)),
        "peak_host_bytes": host.host_bytes if host else 0,
        "peak_host_task": host.name if host else None,
        "peak_device_bytes": dev.device_bytes if dev else 0,
        "peak_device_task": dev.name if dev and dev.device_bytes else None,
        "flops": int(sum(p.flops for p in plans)),
        "device_hours": sum(p.seconds for p in todo if p.uses_device) / 3600.0,
        "devices": int(devices),
        "wall_seconds": wall_seconds(plans, devices),
    }


def by_family(plans: Sequence[TaskPlan]) -> dict[str, list[TaskPlan]]:
    """The plans grouped by family, in the order each family first appears."""
    out: dict[str, list[TaskPlan]] = {}
    for p in plans:
        out.setdefault(p.family, []).append(p)
    return out


def human(n: float, unit: str = "B") -> str:
    """``n`` with a binary (bytes) or decimal prefix: ``1.5 GiB``, ``3.2 PFLOP``."""
    if unit == "B":
        for u in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
            if abs(n) < 1024 or u == "PiB":
                return f"{n:.0f} {u}" if u == "B" else f"{n:.1f} {u}"
            n /= 1024
    for u in ("", "K", "M", "G", "T", "P", "E"):
        if abs(n) < 1000 or u == "E":
            return f"{n:.1f} {u}{unit}"
        n /= 1000
    return str(n)


def seconds_text(s: float) -> str:
    """Seconds as ``12.3 s``, ``4.5 min`` or ``6.7 h``."""
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def table(plans: Sequence[TaskPlan], tot: Mapping[str, Any], dev: Device, accelerator: bool) -> str:
    """The plan as a text table, one line per task grouped by family (a family of many tasks, such
    as the store's shards, prints its largest and a line of sums), then the totals."""
    head = (
        f"{'task':<38} {'host':>9} {'device':>9} {'weights':>9} {'optim':>9} {'activ':>9} {'buffers':>9} "
        f"{'written':>9} {'FLOPs':>10} {'time':>9}"
    )
    lines = [
        f"plan on {dev.name} ({dev.source}); MFU train {dev.mfu['train']:.0%}, forward {dev.mfu['forward']:.0%}",
        head,
        "-" * len(head),
    ]

    def row(name: str, p: TaskPlan, written: int, fl: int, secs: float) -> str:
        parts = p.device if accelerator and p.uses_device else p.host
        return (
            f"{name[:38]:<38} {human(p.host_bytes):>9} {human(p.device_bytes):>9} {human(parts['weights']):>9} "
            f"{human(parts['optimizer']):>9} {human(parts['activations']):>9} {human(parts['buffers']):>9} "
            f"{human(written):>9} {human(fl, 'FLOP'):>10} {seconds_text(secs):>9}" + ("  (done)" if p.done else "")
        )

    for fam, ps in by_family(plans).items():
        if len(ps) > 4:
            big = max(ps, key=lambda p: (p.host_bytes + p.device_bytes, p.seconds))
            lines.append(row(f"{fam} x{len(ps)} (largest)", big, big.bytes_written, big.flops, big.seconds))
            lines.append(
                f"{'  ' + fam + ' summed':<38} {'':>9} {'':>9} {'':>9} {'':>9} {'':>9} {'':>9} "
                f"{human(sum(p.bytes_written for p in ps)):>9} "
                f"{human(sum(p.flops for p in ps), 'FLOP'):>10} {seconds_text(sum(p.seconds for p in ps)):>9}"
            )
        else:
            lines += [row(f"{p.family} {p.name.split(' ', 1)[-1]}", p, p.bytes_written, p.flops, p.seconds) for p in ps]
    lines += [
        "",
        f"store: {human(tot['store_bytes'])}; written by tasks still to run: {human(tot['bytes_written'])}"
        f" (disk needed with checkpoints: {human(tot['disk_needed_bytes'])})",
        f"peak host memory: {human(tot['peak_host_bytes'])} ({tot['peak_host_task']})"
        + (
            f"; peak device memory: {human(tot['peak_device_bytes'])} ({tot['peak_device_task']})"
            if tot["peak_device_bytes"]
            else ""
        ),
        f"FLOPs: {human(tot['flops'], 'FLOP')}; device-hours: {tot['device_hours']:.3f}; "
        f"wall time on {tot['devices']} device(s): {seconds_text(tot['wall_seconds'])}",
        "(predictions: docs/scale.md gives the measured error of each)",
    ]
    return "\n".join(lines)
