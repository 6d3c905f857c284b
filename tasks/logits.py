"""The top-k logit store: TeacherLogits (the teacher's top-k targets over one range of sequences)
and TeacherLogitStore (their join), what Heal and DistillE2E read with ``targets = "cached"``.
Built, checked and read by the boundary store's machinery (:mod:`zgcore.data.logit_store`),
over the same sequence ranges as the boundary cache's shards."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import luigi

from zgcore.data import boundary_store, logit_store
from zgcore.training.memory import PeakRSS

from .base import HIDDEN
from .cache import _JoinTask, _ShardTask
from .teacher import teacher_record


def logit_settings(h: Mapping[str, Any]) -> dict[str, Any]:
    """What a logit store holds, from a Heal or DistillE2E section ``h``: ``{"top_k", "temperature"}``."""
    return {"top_k": int(h["top_k"]), "temperature": float(h["temperature"])}


class _LogitTask:
    """What the logit shard and the join share: their settings and the entries both records carry."""

    logits = luigi.DictParameter(visibility=HIDDEN, description='{"top_k": k, "temperature": T}')

    def cache_extra(self, rec: dict[str, Any]) -> dict[str, Any]:
        """As the boundary cache's, with the teacher run as Heal runs it online (float32; the
        device's autocast) and the store's kind, ``top_k`` and ``temperature``."""
        k, t = int(self.logits["top_k"]), float(self.logits["temperature"])
        return {**super().cache_extra(rec), "teacher_dtype": "float32", **logit_store.store_extra(k, t)}


class TeacherLogits(_LogitTask, _ShardTask):
    """Run the frozen teacher (the causal LM as online distillation loads it,
    :func:`zgcore.models.teacher.load`: float32, under the device's autocast) one sequence at a
    time over one contiguous range of sequences of one split, and store each token's top-k ids,
    log-probabilities and tail log-mass at ``temperature`` (:mod:`zgcore.data.logit_store`): one
    checksummed HDF5 file (an xxh3_64 per sequence) and ``shard.json``. The same ranges as
    :class:`~tasks.cache.BoundaryShard` (``boundary.shard_sequences``)."""

    # 2: store format 5 records (each file's data range and the SHA-256 of its other bytes, checked at open)
    # 3: no SHA-256 of b0.h5 in task.json (its own checks, below)
    code_version = 3
    # its file carries its own checks (an xxh3_64 per sequence checked on every read, the SHA-256 of
    # its bytes outside the sequence data checked at open, the whole file's SHA-256 in shard.json for
    # `zerograph verify`), as the boundary shards' do: hashing it in every complete() would read the
    # whole store in every worker
    content_hashes = False

    def own_config(self):
        # neither boundary.batch_size (the teacher runs one sequence at a time) nor teacher_dtype (always float32)
        return {"logits": logit_settings(self.logits), "split": self.split, "lo": self.lo, "hi": self.hi,
                "format_version": boundary_store.FORMAT_VERSION}

    def run(self):
        import numpy as np
        import torch

        from zgcore.device import autocast, resolve
        from zgcore.models.teacher_stream import activation_bytes, teacher_for

        rss = PeakRSS().start()
        rec = teacher_record(self.teacher_task())
        rows = self.rows()
        # the whole causal LM, or (teacher_stream) its layers one at a time over the whole shard, one sequence a batch
        model = teacher_for(rec, rec["n_layers"], "float32", self.device, head=True,
                            activations=activation_bytes(*rows.shape, rec["hidden_size"], "float32", 0))
        k, t = int(self.logits["top_k"]), float(self.logits["temperature"])
        if hasattr(model, "precompute"):  # at the writer's first sequence, inside its timing
            model.precompute([torch.from_numpy(r[None].astype(np.int64)) for r in rows], head=True, lazy=True,
                             progress=lambda d, n: self.progress(d, n, f"teacher layer {d}/{n}"))
        with self.building() as tmp, autocast(resolve(self.device)):
            r = logit_store.write_logit_shard(tmp, model, rows, self.split, self.lo, k, t, int(self.boundary["batch_size"]),
                                              self.cache_extra(rec), peak_rss=rss.stop,
                                              desc=self.title(),
                                              progress=lambda d, n: self.progress(d, n, f"teacher top-{k} {d}/{n} sequences"))
        self.log(f"top-{k} targets of {r['hi'] - r['lo']} sequences in {r['build_seconds']:.1f} s")


class TeacherLogitStore(_LogitTask, _JoinTask):
    """The top-k logit store: the join of its :class:`TeacherLogits` shards (manifest with every
    shard file's size and checksum, build times and bytes), read by Heal and DistillE2E with
    ``targets = "cached"`` (:func:`zgcore.data.logit_store.open_store`)."""

    shard_class = TeacherLogits

    def shard_task(self, split, lo, hi):
        return self.shared(TeacherLogits, boundary=self.boundary, logits=self.logits, split=split, lo=lo, hi=hi,
                           device=self.device)

    def own_config(self):
        return {"logits": logit_settings(self.logits), "format_version": boundary_store.FORMAT_VERSION}

    def label(self):
        return f"logits-top{int(self.logits['top_k'])}-T{float(self.logits['temperature']):g}"


def logit_store_task(task, h: Mapping[str, Any]) -> TeacherLogitStore:
    """The logit store a Heal or DistillE2E ``task`` reads with its section ``h`` (``top_k``, ``temperature``)."""
    return task.shared(TeacherLogitStore, boundary=task.boundary, logits=logit_settings(h), device=task.device)
