"""``zerograph plan`` and the pre-flight: the plan (:mod:`zgcore.evaluation.plan`) of the graph a
workflow builds, from the same options, before anything runs.

The graph is the workflow's own (its root tasks walked, :func:`workflows.experiment.walk`), with
the teacher read from its ``config.json`` alone (:func:`zgcore.models.teacher.config_only`: no
weights, no tokenizer). The boundary store's shard tasks are laid out for the planned corpus
(:func:`zgcore.data.boundary_store.plan_shards`), whether or not it is tokenised yet.

The corpus's size, when ``--tokens`` is not given: the tokenised corpus's own (its ``meta.json``)
once PrepareCorpus has run; before, its sources' characters (the standard library's reference text,
files) at :data:`CHARS_PER_TOKEN` (1 for the tiny teachers' byte tokenizer, 4 for a BPE
tokenizer on English text), capped by ``corpus.max_tokens``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any
from collections.abc import Mapping

CHARS_PER_TOKEN = {"byte": 1.0, "bpe": 4.0}


def plain(obj: Any) -> Any:
    """A Luigi (frozen) parameter value as plain JSON types."""
    return json.loads(json.dumps(obj, default=lambda o: dict(o) if hasattr(o, "keys") else list(o)))


def source_chars(corpus: Mapping[str, Any]) -> int:
    """Characters (bytes for files) of a corpus's sources, read without tokenising."""
    src = corpus["source"]
    if src == "pydoc":
        from pydoc_data.topics import topics

        return sum(len(v) for v in topics.values())
    if src == "python-stdlib":
        from zgcore.data.sources import stdlib_root

        return sum(p.stat().st_size for p in Path(stdlib_root()).rglob("*.py"))
    from zgcore.config.experiment import corpus_files

    return sum(Path(f).stat().st_size for f in corpus_files(corpus))


def corpus_tokens(corpus: Mapping[str, Any], teacher: str, built: Path | None) -> int:
    """The tokens the corpus holds: its ``meta.json`` when built, else an estimate (module docstring)."""
    if built is not None and (built / "meta.json").is_file():
        return int(json.loads((built / "meta.json").read_text())["tokens"])
    per = CHARS_PER_TOKEN["byte" if str(teacher).startswith("tiny-") else "bpe"]
    n = int(source_chars(corpus) / per)
    cap = int(corpus.get("max_tokens") or 0)
    return min(n, cap) if cap else n


def split_rows(tokens: int, corpus: Mapping[str, Any]) -> tuple[int, int]:
    """``(n_train, n_val)`` sequences of ``tokens`` tokens cut into ``seq_len`` rows, split as
    :func:`zgcore.data.corpus.split_indices` splits them."""
    n = max(2, int(tokens) // int(corpus["seq_len"]))
    n_val = max(1, round(n * float(corpus["val_fraction"])))
    return n - n_val, n_val


def graph_tasks(roots: list, tokens: int | None) -> tuple[list, dict, tuple[int, int]]:
    """The planned graph: ``(tasks, deps, (n_train, n_val))`` with every task of ``roots``
    (dependencies first), the store's shards laid out for the planned corpus, and ``deps``: each
    task id's dependency ids."""
    from luigi.task import flatten

    from tasks.cache import _JoinTask, _ShardTask
    from tasks.teacher import PrepareCorpus

    from .experiment import walk

    seen: dict[str, Any] = {}
    for r in roots:
        for t in walk(r):
            seen.setdefault(t.task_id, t)
    walked = [t for t in seen.values() if not isinstance(t, _ShardTask)]
    corpora = [t for t in walked if type(t) is PrepareCorpus]
    if tokens is None and corpora:
        c = corpora[0]
        meta = c.out_dir / "meta.json"
        if meta.is_file():
            m = json.loads(meta.read_text())
            sizes = (int(m["n_train"]), int(m["n_val"]))
        else:
            sizes = split_rows(corpus_tokens(plain(c.corpus), c.teacher, None), plain(c.corpus))
    elif corpora:
        sizes = split_rows(int(tokens), plain(corpora[0].corpus))
    else:  # local learning: its own corpus task
        sizes = split_rows(int(tokens or 1 << 20), {"seq_len": 256, "val_fraction": 0.1})
    from zgcore.data.boundary_store import plan_shards

    out, deps = [], {}
    for t in walked:
        d = [x.task_id for x in flatten(t.requires()) if not isinstance(x, _ShardTask)]
        if isinstance(t, _JoinTask):
            shards = [
                t.shard_task(s, lo, hi)
                for s, lo, hi in plan_shards({"train": sizes[0], "val": sizes[1]}, int(t.boundary["shard_sequences"]))
            ]
            for s in shards:
                out.append(s)
                deps[s.task_id] = [x.task_id for x in flatten(s.requires())]
            d += [s.task_id for s in shards]
        out.append(t)
        deps[t.task_id] = d
    return out, deps, sizes


def make_plan(roots: list, tokens: int | None, dev, devices: int, accelerator: bool | None = None) -> dict[str, Any]:
    """The plan of the graph under ``roots`` on ``devices`` devices ``dev`` (a
    :class:`zgcore.evaluation.accelerators.Device`):
    ``{"tasks": [TaskPlan], "totals", "device", "context", "n_train", "n_val"}``. ``accelerator``: the
    tasks' model lives in device memory (default: the graph's ``device`` setting is ``cuda``, or
    ``dev`` is an accelerator)."""
    from zgcore.evaluation import plan
    from zgcore.evaluation.plan_costs import Context
    from zgcore.evaluation.plan_shape import read_config, shape_of

    tasks, deps, (n_train, n_val) = graph_tasks(roots, tokens)
    teacher = next((t.teacher for t in tasks if hasattr(t, "teacher")), None) or next(
        (t.tokenizer for t in tasks if hasattr(t, "tokenizer")), "smollm2-135m"
    )
    on_acc = (
        accelerator
        if accelerator is not None
        else (dev.accelerator or str(getattr(tasks[-1], "device", "cpu")).startswith("cuda"))
    )
    ctx = Context(shape_of(read_config(str(teacher))), n_train, n_val, bool(on_acc))
    specs = [
        plan.TaskSpec(
            t.task_id,
            t.get_task_family(),
            t.title(),
            plain(t.param_kwargs),
            deps.get(t.task_id, ()),
            bool(getattr(t, "uses_device", True)),
            t.out_dir.is_dir() and tokens is None,
        )
        for t in tasks
    ]
    plans = plan.plan_tasks(specs, ctx, dev)
    return {
        "tasks": plans,
        "totals": plan.totals(plans, devices),
        "device": dev,
        "accelerator": bool(on_acc),
        "n_train": n_train,
        "n_val": n_val,
        "teacher": str(teacher),
    }


def plan_record(p: Mapping[str, Any]) -> dict[str, Any]:
    """A plan as ``zerograph plan --json`` prints it: ``tasks`` (each :meth:`TaskPlan.record`),
    ``totals``, the device (name, peak FLOP/s, memory, source, MFU) and the corpus's sequences."""
    d = p["device"]
    return {
        "tasks": [t.record() for t in p["tasks"]],
        "totals": p["totals"],
        "device": {
            "name": d.name,
            "peak_flops_per_second": d.peak,
            "memory_bytes": d.memory,
            "source": d.source,
            "mfu": d.mfu,
        },
        "accelerator": p["accelerator"],
        "teacher": p["teacher"],
        "n_train": p["n_train"],
        "n_val": p["n_val"],
        "prediction": True,
    }


PREFLIGHT_ENV = "ZG_PREFLIGHT"  # 0: skip the pre-flight
MEMORY_LIMIT_ENV = "ZG_MEMORY_LIMIT_BYTES"  # the host memory a task may use (default: what the machine has free)
FREE_DISK_ENV = "ZG_FREE_DISK_BYTES"  # the outputs folder's free bytes (default: what its file system reports)


def _nominal_device():
    from zgcore.evaluation.accelerators import Device

    return Device("unrated", 1e12, 0, "none (bytes only)", {"train": 1.0, "forward": 1.0}, accelerator=False)


def free_host_memory() -> int:
    """Bytes of host memory a task may use: :data:`MEMORY_LIMIT_ENV` when set, else the machine's
    available memory (``MemAvailable``), lowered to the cgroup's limit when it runs in one (a Slurm job)."""
    if os.environ.get(MEMORY_LIMIT_ENV):
        return int(float(os.environ[MEMORY_LIMIT_ENV]))
    import psutil

    free = int(psutil.virtual_memory().available)
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            free = min(free, int(limit) - used)
    except (OSError, ValueError):
        pass
    return free


def free_disk(outputs: str | os.PathLike) -> int:
    """Free bytes of the file system holding ``outputs`` (its nearest existing folder), or :data:`FREE_DISK_ENV`."""
    if os.environ.get(FREE_DISK_ENV):
        return int(float(os.environ[FREE_DISK_ENV]))
    p = Path(outputs).absolute()
    while not p.exists():
        p = p.parent
    return int(shutil.disk_usage(p).free)


def free_device_memory(device: str) -> int | None:
    """Free bytes of the CUDA device ``device`` (None: not a CUDA device, or none is visible)."""
    if not str(device).startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def _remedy(p, cfg: Mapping[str, Any]) -> str:
    """The settings that shrink the largest part of ``p``'s memory."""
    parts = dict(p.device if p.device_bytes else p.host)
    parts.pop("process", None)
    big = max(parts, key=parts.get)
    stream = "teacher_stream=true, " if "teacher_stream" in cfg else ""
    if p.family in ("BoundaryShard", "TeacherLogits"):
        return {
            "weights": f"{stream}boundary.teacher_dtype=bfloat16",
            "activations": "a smaller boundary.batch_size",
        }.get(big, "a smaller boundary.shard_sequences")
    if p.kind == "train":
        return {
            "activations": "a smaller train.batch_size (heal.batch_size for healing)",
            "buffers": "a smaller train.batch_size or train.prefetch",
        }.get(big, "more partitions (boundary.num_blocks) or a smaller train.batch_size")
    if big == "activations":
        return "a smaller eval.batch_size"
    return f"{stream}a machine with more memory"


def preflight(root, outputs: str | None = None) -> str | None:
    """One line saying why the graph of the workflow ``root`` cannot run here, or None: the bytes
    its tasks still to run write (and their largest checkpoints) against the free space of the
    outputs folder, and each task's peak host memory (and device memory on CUDA) against what is
    free (:func:`free_host_memory`, :func:`free_device_memory`). Names the task, the need, what is
    free and the setting that helps."""
    from zgcore.evaluation.plan import human

    cfg = getattr(root, "cfg", {}) or {}
    out = outputs or str(getattr(root, "outputs", "outputs"))
    roots = root.requires()
    roots = list(roots) if isinstance(roots, (list, tuple)) else [roots]
    p = make_plan(roots, None, _nominal_device(), 1)
    need, disk = p["totals"]["disk_needed_bytes"], free_disk(out)
    if need > disk:
        codec = "boundary.codec, " if "codec" in cfg.get("boundary", {}) else ""
        return (
            f"pre-flight: the tasks still to run write {human(need)} under {out}, which has {human(disk)} free: "
            f"store fewer bytes ({codec}boundary.dtype=bfloat16, a smaller corpus.max_tokens) or free space"
        )
    todo = [t for t in p["tasks"] if not t.done]
    host = free_host_memory()
    for t in sorted(todo, key=lambda t: -t.host_bytes):
        if t.host_bytes > host:
            return (
                f"pre-flight: task {t.name} needs {human(t.host_bytes)} of host memory, {human(host)} is free: "
                f"try {_remedy(t, cfg)}"
            )
        break
    dev = free_device_memory(str(cfg.get("device", "cpu")))
    for t in sorted(todo, key=lambda t: -t.device_bytes):
        if dev is not None and t.device_bytes > dev:
            return (
                f"pre-flight: task {t.name} needs {human(t.device_bytes)} of device memory, {human(dev)} is free: "
                f"try {_remedy(t, cfg)}"
            )
        break
    return None


def slurm_requests(root, workers: int) -> dict[str, str]:
    """Slurm request sizes from the plan of ``root``'s graph: ``mem`` (the largest task's host memory
    and a quarter more, in whole GiB, as ``--mem`` takes it) and ``time`` (the wall time on ``workers``
    workers, doubled, at least 10 minutes, as ``--time`` takes it). Speed: this machine's probe for a
    CPU graph; for ``device = cuda`` the H100's datasheet peak (the login host has no GPU to probe)."""
    from zgcore.evaluation.accelerators import ACCELERATORS, device

    roots = root.requires()
    roots = list(roots) if isinstance(roots, (list, tuple)) else [roots]
    cfg = getattr(root, "cfg", {}) or {}
    gpu = str(cfg.get("device", "cpu")).startswith("cuda")
    p = make_plan(roots, None, ACCELERATORS["h100"] if gpu else device("cpu"), max(1, int(workers)))
    mem = max(1, -(-int(p["totals"]["peak_host_bytes"] * 1.25) // 2**30))
    secs = max(600, int(2 * p["totals"]["wall_seconds"]))
    return {"mem": f"{mem}G", "time": f"{secs // 3600:02d}:{secs % 3600 // 60:02d}:{secs % 60:02d}"}


def slurm_sizes(root, workers: int, mem: str | None, time_limit: str | None) -> tuple[str, str]:
    """``--mem`` and ``--time`` as given, else sized by the plan of ``root``'s graph (:func:`slurm_requests`)."""
    if mem and time_limit:
        return mem, time_limit
    r = slurm_requests(root, workers)
    return mem or r["mem"], time_limit or r["time"]
