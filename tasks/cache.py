"""The teacher cache: BoundaryShard (the teacher's boundaries over one range of sequences) and
TeacherBoundary (their join, the store every cached TrainBlock reads)."""
from __future__ import annotations

import json
from functools import cached_property
from typing import Any

import luigi

from zgcore.data import boundary_store, corpus
from zgcore.data.boundary_store import codec
from zgcore.models.shapes import resolve_boundaries
from zgcore.device import precision
from zgcore.hashing import canonical, config_hash
from zgcore.training.memory import PeakRSS

from zgcore.atomic import write_json
from zgcore.evaluation import flops
from zgcore.training import mfu

from .base import HIDDEN
from .teacher import PrepareCorpus, _TeacherTask, teacher_record


SHARD_METRICS = "metrics.json"  # in each BoundaryShard folder: its seconds, FLOPs and MFU


def cache_settings(boundary) -> dict[str, Any]:
    """The boundary settings that change what the cache holds, as :class:`zgcore.config.schema.Boundary`
    declares them (``shard_sequences`` only changes how its build is split over tasks: the bytes are
    identical, so it is never hashed)."""
    from zgcore.config.fields import hashed_view
    from zgcore.config.schema import Boundary

    return hashed_view(Boundary, canonical(boundary))


def split_sizes(meta: dict[str, Any]) -> dict[str, int]:
    """``{"train": n_train, "val": n_val}`` of a prepared corpus's ``meta.json``."""
    return {"train": int(meta["n_train"]), "val": int(meta["n_val"])}


class _CacheTask(_TeacherTask):
    corpus = luigi.DictParameter(visibility=HIDDEN)
    boundary = luigi.DictParameter(visibility=HIDDEN)

    def corpus_task(self) -> PrepareCorpus:
        return self.shared(PrepareCorpus)

    def cache_extra(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Entries every shard and the join's manifest carry (and must agree on)."""
        meta = json.loads((self.corpus_task().out_dir / "meta.json").read_text())
        return {"teacher_fingerprint": rec["fingerprint"], "tokenizer": meta["tokenizer"],
                "corpus_fingerprint": meta["fingerprint"], "teacher_dtype": self.boundary["teacher_dtype"]}


class _ShardTask(_CacheTask):
    """One shard of a store built by the teacher: a contiguous range ``lo .. hi - 1`` of one
    split's sequences (the ranges of :func:`zgcore.data.boundary_store.plan_shards`), one folder
    written atomically by :func:`zgcore.data.boundary_store.write_shard` (checksummed file(s) and
    ``shard.json``); complete when every file has its recorded size (content is checked on read)."""

    split = luigi.Parameter(description="train | val")
    lo = luigi.IntParameter(description="first sequence of the range")
    hi = luigi.IntParameter(description="one past the last sequence of the range")

    def requires(self):
        return {"teacher": self.teacher_task(), "corpus": self.corpus_task()}

    def label(self):
        return f"{self.split}-{self.lo:08d}-{self.hi:08d}"

    def verify(self):
        return boundary_store.shard_problem(self.out_dir)

    def rows(self):
        """Token ids ``[hi - lo, seq_len]`` of the shard's range."""
        return corpus.read_tokens(self.corpus_task().out_dir / "tokens.h5", self.split)[self.lo: self.hi]


class BoundaryShard(_ShardTask):
    """Run the frozen teacher (its layers up to the last boundary, never the LM head, in
    ``teacher_dtype``) over one contiguous range of sequences of one split and store every
    boundary of that range: one checksummed HDF5 file per boundary (an xxh3_64 per sequence), and
    ``shard.json`` (each file's SHA-256, and that of its bytes outside the sequence data)."""

    # 2: load_base runs each family with its own attention implementation (Gemma 2: eager, soft-capped)
    # 3: format 4 files (h contiguous and unfiltered, an xxh3_64 per sequence)
    # 4: format 5 records (each file's data range and the SHA-256 of its other bytes, checked at open)
    # 5: format 6 (values checked finite as stored, after rounding; a read checks the xxh3 only)
    code_version = 5
    # its files carry their own SHA-256 (shard.json, the join's manifest), checked by the reader when
    # it first opens each file: hashing them again in every complete() would read the whole cache
    content_hashes = False

    def own_config(self):
        return {"boundary": cache_settings(self.boundary), "split": self.split, "lo": self.lo, "hi": self.hi,
                "format_version": boundary_store.FORMAT_VERSION}

    def run(self):
        import numpy as np
        import torch

        from zgcore.models.teacher_stream import activation_bytes, teacher_for

        rss = PeakRSS().start()  # this shard task's peak resident memory (recorded in shard.json)
        rec = teacher_record(self.teacher_task())
        bs = resolve_boundaries(self.boundary, rec["n_layers"])
        rows = self.rows()
        dt = self.boundary["teacher_dtype"]
        # the whole teacher up to the last boundary, or (teacher_stream) its layers one at a time over the whole shard
        act = activation_bytes(*rows.shape, rec["hidden_size"], dt, len(bs))
        model = teacher_for(rec, max(bs), dt, self.device, activations=act)
        if hasattr(model, "precompute"):  # at the writer's first batch, inside its timing
            model.precompute([torch.from_numpy(r[None].astype(np.int64)) for r in rows], bs, lazy=True,
                             progress=lambda d, n: self.progress(d, n, f"teacher layer {d}/{n} over {len(rows)} sequences"))
        with self.building() as tmp:
            r = boundary_store.write_shard(tmp, model, rows, self.split, self.lo, bs, self.boundary["dtype"],
                                           int(self.boundary["batch_size"]), self.cache_extra(rec),
                                           progress=lambda d, n: self.progress(d, n, f"teacher forward {d}/{n} sequences"),
                                           peak_rss=rss.stop, desc=self.title(), codec=codec.settings(self.boundary))
            # the teacher forward's FLOPs against this process's matmul peak (the report's utilisation table)
            write_json(tmp / SHARD_METRICS, {"seconds": r["build_seconds"], **mfu.utilisation(
                flops.cache_build_flops(flops.decoder_parameters(model), len(rows), rows.shape[1], max(bs)),
                r["build_seconds"], self.device)})
        self.log(f"built {r['hi'] - r['lo']} sequences in {r['build_seconds']:.1f} s")


class _JoinTask(_CacheTask):
    """The join of a store's shard tasks (``shard_class``, each a contiguous range of
    ``boundary.shard_sequences`` sequences): writes the manifest (every shard's files with sizes
    and checksums, build times) and the statistics (:func:`zgcore.data.boundary_store.join_shards`);
    presents the shards as one store without copying them (a
    :class:`zgcore.data.boundary_store.BoundaryReader` indexes the shard files).

    The shards are known once the corpus is tokenised: then they are static requirements, which
    every worker of a luigid sees and shares; otherwise ``run`` yields them (Luigi's dynamic
    requirements, run by this worker's processes)."""

    uses_device = False  # the join reads shard records and statistics rows only
    shard_class: type[_ShardTask] = _ShardTask

    def requires(self):
        deps = {"teacher": self.teacher_task(), "corpus": self.corpus_task()}
        return {**deps, "shards": self.static_shards} if self.static_shards is not None else deps

    @property
    def static_shards(self) -> list[_ShardTask] | None:
        """The shard tasks as static requirements, or None. Decided when first asked; an instance
        that started without them (corpus not yet tokenised: ``run`` yields them) takes them on
        only once all are complete, since Luigi checks at run time that ``requires`` is complete
        (Luigi reuses one instance per parameter set within a process)."""
        if "_static" not in self.__dict__ or self._static is None:
            shards = self.shard_tasks()
            first = "_static" not in self.__dict__
            self._static = shards if shards is not None and (first or all(t.complete() for t in shards)) else None
        return self._static

    @cached_property
    def uid(self) -> str:
        """Hash of the store's settings, the teacher and corpus, its own code version and its shards'
        numerics (their code version and compute precision: a bf16-autocast store is another store),
        but not of the shard plan, which changes no byte."""
        shards = {"code_version": int(self.shard_class.code_version), "precision": precision(self.device)}
        return config_hash(self.get_task_family(), {"config": self.own_config(), **self.numerics(), "shards": shards},
                           [self.teacher_task().uid, self.corpus_task().uid])

    def shard_task(self, split: str, lo: int, hi: int) -> _ShardTask:
        """The shard task of one range."""
        raise NotImplementedError

    def shard_tasks(self) -> list[_ShardTask] | None:
        """The shard tasks, or None while the corpus (and so the number of sequences) is unknown."""
        meta = self.corpus_task().out_dir / "meta.json"
        if not meta.is_file():
            return None
        m = json.loads(meta.read_text())
        return [self.shard_task(s, lo, hi)
                for s, lo, hi in boundary_store.plan_shards(split_sizes(m), int(self.boundary["shard_sequences"]))]

    def verify(self):
        man = self.out_dir / boundary_store.MANIFEST
        if not man.is_file():
            return f"{boundary_store.MANIFEST} missing"
        for sh in json.loads(man.read_text())["shards"]:
            for f in sh["files"].values():
                p = self.out_dir / sh["dir"] / f["name"]
                if not p.is_file() or p.stat().st_size != f["bytes"]:
                    return f"shard file {p} is missing or not {f['bytes']} bytes"
        return None

    def run(self):
        shards = self.shard_tasks()
        yield shards  # complete when they were static requirements; else Luigi runs them first
        rec = teacher_record(self.teacher_task())
        meta = json.loads((self.corpus_task().out_dir / "meta.json").read_text())
        with self.building() as tmp:
            # tmp is out_dir's sibling: the shard paths the manifest records relative to it hold for out_dir
            m = boundary_store.join_shards(tmp, [t.out_dir for t in shards], split_sizes(meta), self.cache_extra(rec))
        self.log(f"{m['n_shards']} shard(s), {m['bytes'] / 2**20:.1f} MiB; teacher time {m['build_seconds']:.1f} s "
                 f"summed over shards, {m['build_wall_seconds']:.1f} s wall")


class TeacherBoundary(_JoinTask):
    """The teacher cache: the join of its :class:`BoundaryShard` tasks, the store every cached
    TrainBlock reads (see :class:`_JoinTask`)."""

    shard_class = BoundaryShard

    def shard_task(self, split, lo, hi):
        return self.shared(BoundaryShard, boundary=self.boundary, split=split, lo=lo, hi=hi, device=self.device)

    def own_config(self):
        return {"boundary": cache_settings(self.boundary), "format_version": boundary_store.FORMAT_VERSION}

    def label(self):
        return "boundaries"
