"""Cache economics: what materialising the teacher's boundaries (or its top-k logits) cost, and
when it pays off, from measured times; and their Markdown sections for the experiment report
(:mod:`zgcore.evaluation.report`).

Source: ZeroGraph (arXiv:2611.02200), cache economics.
"""
from __future__ import annotations

import math
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from zgcore.markdown import num, table


def cache_economics(build_seconds: float, build_bytes: int, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Cache economics: what materialising the teacher's boundaries cost and when it pays off.

    Args:
        build_seconds: wall time of the cache build (s). build_bytes: its size on disk (bytes).
        jobs: one dict per TrainBlock with ``cached_seconds`` (wall time of the job with cached
            targets) and ``online_seconds`` (the same job with online targets), both in s.

    Returns:
        ``per_job`` (the jobs with their saving), ``experiment_cached_seconds`` /
        ``experiment_online_seconds`` (all jobs once; cached includes the build),
        ``break_even_reuses``: the smallest number N of full experiments (each running every job
        once) for which ``build + N * sum(cached) < N * sum(online)`` — None if online is never
        slower — and ``break_even_jobs``, the same count in single average jobs.

    Source: ZeroGraph (arXiv:2611.02200) reports a 618.31 s build with no break-even through 16 reuses.
    """
    cached = sum(j["cached_seconds"] for j in jobs)
    online = sum(j["online_seconds"] for j in jobs)
    saving = online - cached
    out = {"build_seconds": build_seconds, "build_bytes": build_bytes,
           "per_job": [{**j, "saving_seconds": j["online_seconds"] - j["cached_seconds"]} for j in jobs],
           "experiment_cached_seconds": build_seconds + cached, "experiment_online_seconds": online,
           "break_even_reuses": None, "break_even_jobs": None}
    if saving > 0:
        out["break_even_reuses"] = math.floor(build_seconds / saving) + 1
        per_job = saving / len(jobs)
        out["break_even_jobs"] = math.floor(build_seconds / per_job) + 1
    return out


def economics(manifest: Mapping[str, Any], blocks: Sequence[Mapping[str, Any]], batch_sizes: Sequence[int],
              teacher_seconds: Callable[[int, int, int], float]) -> dict[str, Any]:
    """Cache economics of one experiment from measured times.

    Each block job's time in the mode it ran in is measured; the other mode is projected. A cached
    job's online time is its compute time plus the teacher's forward time per batch times its steps.
    An online job's cached time is its compute and data time less its teacher time: a lower bound,
    since an online job reads nothing from the store.

    Args:
        manifest: the boundary store's manifest (``build_seconds`` summed over shards, ``bytes``,
            ``n_train``, ``n_val``; ``n_shards`` and ``build_wall_seconds`` when sharded).
        blocks: each TrainBlock's ``metrics.json`` (``block``, ``start``, ``end``, ``targets``,
            ``steps``, ``seconds``, ``data_seconds``, ``compute_seconds``, ``teacher_seconds``).
        batch_sizes: each block's batch size (sequences), in block order.
        teacher_seconds: ``(start, end, batch_size) -> s``, the teacher's forward time for one batch
            up to boundary ``end`` (see :func:`zgcore.evaluation.metrics.teacher_forward_seconds`).

    Returns:
        :func:`cache_economics`'s dict plus ``build_seconds_per_sequence``, ``shards``,
        ``build_wall_seconds`` and ``method`` (one sentence for the report).
    """
    jobs, timed = [], {}
    for b in blocks:
        key = (b["start"], b["end"], int(batch_sizes[b["block"]]))
        if key not in timed:
            timed[key] = teacher_seconds(*key)
        if b["targets"] == "online":
            online, teacher_s = b["seconds"], b["teacher_seconds"]
            cached = b["compute_seconds"] + b["data_seconds"] - teacher_s  # no measured read time: a lower bound
        else:
            cached, teacher_s = b["seconds"], b["steps"] * timed[key]
            online = b["compute_seconds"] + teacher_s
        jobs.append({"block": b["block"], "cached_seconds": cached, "online_seconds": online,
                     "data_seconds": b["data_seconds"], "compute_seconds": b["compute_seconds"],
                     "online_teacher_seconds": teacher_s, "steps": b["steps"], "measured": b["targets"]})
    econ = cache_economics(manifest["build_seconds"], manifest["bytes"], jobs)
    econ["build_seconds_per_sequence"] = manifest["build_seconds"] / (manifest["n_train"] + manifest["n_val"])
    econ["shards"] = manifest.get("n_shards", 1)
    econ["build_wall_seconds"] = manifest.get("build_wall_seconds", manifest["build_seconds"])
    econ["method"] = ("Each job's time in the mode it ran in is measured; the other mode is projected from its "
                      "measured compute time plus the teacher's forward time per batch up to the block's output "
                      "boundary, timed in this task.")
    return econ


def economics_md(econ: Mapping[str, Any], teacher_layers: int) -> list[str]:
    """The report's "Cache economics" section (Markdown lines) from :func:`economics`."""
    be = econ["break_even_reuses"]
    rows = [[j["block"], num(j["cached_seconds"], ".1f"), num(j["data_seconds"], ".1f"), num(j["compute_seconds"], ".1f"),
             num(j["online_seconds"], ".1f"), num(j["online_teacher_seconds"], ".1f"), num(j["saving_seconds"], ".1f")]
            for j in econ["per_job"]]
    return ["## Cache economics", "",
            f"Cache build: {econ.get('shards', 1)} shard(s), {num(econ['build_seconds'], '.1f')} s teacher time summed "
            f"over shards, {num(econ.get('build_wall_seconds', econ['build_seconds']), '.1f')} s wall, "
            f"{num(econ['build_bytes'] / 2**20, '.1f')} MiB "
            f"({num(econ['build_seconds_per_sequence'] * 1000, '.0f')} ms/sequence through all {teacher_layers} teacher layers).", "",
            table(["block", "cached job (s)", "of which data (s)", "compute (s)", "online job (s)", "online teacher (s)",
                   "saving (s)"], rows), "",
            f"One experiment: cached {num(econ['experiment_cached_seconds'], '.1f')} s (build included) vs online "
            f"{num(econ['experiment_online_seconds'], '.1f')} s. Break-even: "
            + (f"**{be} experiment(s)** ({econ['break_even_jobs']} average block jobs)" if be else "never (online is not slower)")
            + f". {econ['method']}", ""]


def logit_store_cost(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """What the top-k logit store cost, from its manifest: ``top_k``, ``temperature``, ``shards``,
    ``build_seconds`` (teacher time summed over shards, s), ``build_wall_seconds`` (s),
    ``bytes`` (its shard files), ``bytes_per_token`` (``bytes`` over every stored token, HDF5
    and checksums included)."""
    tokens = (int(manifest["n_train"]) + int(manifest["n_val"])) * int(manifest["seq_len"])
    return {"top_k": manifest["top_k"], "temperature": manifest["temperature"], "shards": manifest["n_shards"],
            "build_seconds": manifest["build_seconds"], "build_wall_seconds": manifest["build_wall_seconds"],
            "bytes": manifest["bytes"], "bytes_per_token": manifest["bytes"] / max(1, tokens)}


def logit_store_md(c: Mapping[str, Any]) -> list[str]:
    """The report's "Top-k logit store" section (Markdown lines) from :func:`logit_store_cost`."""
    return ["## Top-k logit store", "",
            (f"The teacher's top-{c['top_k']} targets at T = {c['temperature']:g} (what healing read instead of running "
             f"the teacher): {c['shards']} shard(s), {num(c['build_seconds'], '.1f')} s teacher time summed over shards, "
             f"{num(c['build_wall_seconds'], '.1f')} s wall, {num(c['bytes'] / 2**20, '.2f')} MiB "
             f"({num(c['bytes_per_token'], '.1f')} bytes/token)."), ""]
