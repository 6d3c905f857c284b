"""The experiment graph: PrepareTeacher → PrepareCorpus → TeacherBoundary → TrainBlock(i) → Assemble → Evaluate.

No edge joins two TrainBlocks: each reads only the boundary store.
"""
from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any

import luigi

from zgcore import boundary_store, corpus, metrics, plots, report as zreport, students, teacher as zteacher, train as ztrain
from zgcore.adapters import assemble, build_block, head_logits, head_only
from zgcore.atomic import write_json, write_text
from zgcore.config import corpus_files, kept_layers, resolve_boundaries
from zgcore.device import precision
from zgcore.hashing import canonical, config_hash
from zgcore.memory import PeakRSS
from zgcore.sources import stdlib_root

from .base import HIDDEN, ZGTask
from .work import Resumable


def path_stamp(spec: str) -> list | None:
    """(name, size, mtime) of a local file or the files of a local folder; None for other specs.
    Part of a task's hash so that editing a local teacher or corpus file rebuilds what depends on it."""
    p = Path(os.path.expanduser(str(spec)))
    if not p.exists():
        return None
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file())
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


class PrepareTeacher(ZGTask):
    """Make the teacher loadable offline: fetch/checksum the built-in GGUF and convert it to a
    Hugging Face folder (so later tasks load in seconds), build tiny teachers, or record a local one."""

    uses_device = False  # de-quantises on CPU
    code_deps = ("zgcore.teacher",)

    teacher = luigi.Parameter(description="smollm2-135m | tiny-llama | tiny-qwen2 | tiny-gpt2 | HF folder | .gguf | Hub id")

    def own_config(self):
        return {"teacher": self.teacher, "stamp": path_stamp(self.teacher)}

    def label(self):
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(str(self.teacher)).name)[:40] or "teacher"

    def run(self):
        record = zteacher.materialise(self.teacher, self.outputs, log=self.log)
        with self.building() as tmp:
            if record.get("gguf_file"):
                self.log(f"de-quantising {record['gguf_file']} into a Hugging Face folder (once)")
                model, tok = zteacher.load(record)
                model.save_pretrained(tmp / "model")
                tok.save_pretrained(tmp / "model")
                record = {**record, "source_path": record["path"], "path": "model", "gguf_file": None}
            zteacher.save_record(tmp / "teacher.json", record)


def teacher_record(task: PrepareTeacher) -> dict[str, Any]:
    """A prepared teacher's record with ``path`` made absolute."""
    rec = zteacher.read_record(task.out_dir / "teacher.json")
    if rec["path"] == "model":
        rec["path"] = str((task.out_dir / "model").resolve())
    return rec


class _TeacherTask(ZGTask):
    teacher = luigi.Parameter()

    def load_teacher(self):
        rec = teacher_record(self.teacher_task())
        return rec, zteacher.load(rec, self.device)

    def teacher_task(self) -> PrepareTeacher:
        return PrepareTeacher(teacher=self.teacher, outputs=self.outputs)


class PrepareCorpus(_TeacherTask):
    """Tokenize the corpus with the teacher's tokenizer into fixed-length train/val sequences (HDF5)."""

    uses_device = False  # tokenises only
    code_deps = ("zgcore.corpus", "zgcore.config:corpus_files")

    corpus = luigi.DictParameter(visibility=HIDDEN)

    def requires(self):
        return self.teacher_task()

    def own_config(self):
        src = self.corpus["source"]
        if src == "pydoc":
            stamps = None
        elif src == "python-stdlib":  # the files of this Python's standard library
            import sys

            stamps = [sys.version, str(stdlib_root())]
        else:
            stamps = [path_stamp(str(f)) for f in corpus_files(self.corpus)]
        # buffer_tokens bounds memory only: the same tokens for any value, so it never moves the hash
        return {"corpus": {k: v for k, v in self.corpus.items() if k != "buffer_tokens"}, "stamps": stamps}

    def label(self):
        return f"corpus-T{self.corpus['seq_len']}"

    def run(self):
        from transformers import AutoTokenizer

        rec = teacher_record(self.teacher_task())
        kw = {"gguf_file": rec["gguf_file"]} if rec.get("gguf_file") else {}
        tok = AutoTokenizer.from_pretrained(rec["path"], **kw)
        with self.building() as tmp:
            meta = corpus.build_token_store(tmp / "tokens.h5", self.corpus, tok, rec["spec"], rec["max_positions"],
                                            log=self.log)
            write_json(tmp / "meta.json", meta)
        self.log(f"{meta['tokens']} tokens -> {meta['n_train']} train + {meta['n_val']} val sequences of {meta['seq_len']}"
                 + (f"; {meta['skipped_files']} unusable file(s) skipped" if meta["skipped_files"] else ""))


def cache_settings(boundary) -> dict[str, Any]:
    """The boundary settings that change what the cache holds (``shard_sequences`` only changes
    how its build is split over tasks: the bytes are identical, so it is never hashed)."""
    return {k: v for k, v in canonical(boundary).items() if k != "shard_sequences"}


def split_sizes(meta: dict[str, Any]) -> dict[str, int]:
    """``{"train": n_train, "val": n_val}`` of a prepared corpus's ``meta.json``."""
    return {"train": int(meta["n_train"]), "val": int(meta["n_val"])}


class _CacheTask(_TeacherTask):
    corpus = luigi.DictParameter(visibility=HIDDEN)
    boundary = luigi.DictParameter(visibility=HIDDEN)

    def corpus_task(self) -> PrepareCorpus:
        return PrepareCorpus(teacher=self.teacher, corpus=self.corpus, outputs=self.outputs)

    def cache_extra(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Entries every shard and the join's manifest carry (and must agree on)."""
        meta = json.loads((self.corpus_task().out_dir / "meta.json").read_text())
        return {"teacher_fingerprint": rec["fingerprint"], "tokenizer": meta["tokenizer"],
                "corpus_fingerprint": meta["fingerprint"], "teacher_dtype": self.boundary["teacher_dtype"]}


class BoundaryShard(_CacheTask):
    """Run the frozen teacher (its layers up to the last boundary, never the LM head, in
    ``teacher_dtype``) over one contiguous range of sequences of one split and store every
    boundary of that range: one checksummed HDF5 file per boundary, and ``shard.json``."""

    # 2: load_base runs each family with its own attention implementation (Gemma 2: eager, soft-capped)
    code_version = 2
    code_deps = ("zgcore.boundary_store", "zgcore.adapters:capture_boundaries", "zgcore.config:resolve_boundaries",
                 "zgcore.teacher_weights", "zgcore.device")

    split = luigi.Parameter(description="train | val")
    lo = luigi.IntParameter(description="first sequence of the range")
    hi = luigi.IntParameter(description="one past the last sequence of the range")

    def requires(self):
        return {"teacher": self.teacher_task(), "corpus": self.corpus_task()}

    def own_config(self):
        return {"boundary": cache_settings(self.boundary), "split": self.split, "lo": self.lo, "hi": self.hi,
                "format_version": boundary_store.FORMAT_VERSION}

    def label(self):
        return f"{self.split}-{self.lo:08d}-{self.hi:08d}"

    def verify(self):
        return boundary_store.shard_problem(self.out_dir)

    def run(self):
        from zgcore.teacher_weights import load_base

        rss = PeakRSS().start()  # this shard task's peak resident memory (recorded in shard.json)
        rec = teacher_record(self.teacher_task())
        bs = resolve_boundaries(self.boundary, rec["n_layers"])
        rows = corpus.read_tokens(self.corpus_task().out_dir / "tokens.h5", self.split)[self.lo: self.hi]
        model = load_base(rec, max(bs), self.boundary["teacher_dtype"], self.device)
        with self.building() as tmp:
            r = boundary_store.write_shard(tmp, model, rows, self.split, self.lo, bs, self.boundary["dtype"],
                                           int(self.boundary["batch_size"]), self.cache_extra(rec),
                                           progress=lambda d, n: self.progress(d, n, f"teacher forward {d}/{n} sequences"),
                                           peak_rss=rss.stop)
        self.log(f"built {r['hi'] - r['lo']} sequences in {r['build_seconds']:.1f} s")


class TeacherBoundary(_CacheTask):
    """The teacher cache: the join of its :class:`BoundaryShard` tasks (each a contiguous range of
    ``boundary.shard_sequences`` sequences). Writes the manifest (every shard's files with sizes
    and checksums, build times) and the per-channel statistics; presents the shards as one store
    without copying them (:class:`zgcore.boundary_store.BoundaryReader` indexes the shard files).

    The shards are known once the corpus is tokenised: then they are static requirements, which
    every worker of a luigid sees and shares; otherwise ``run`` yields them (Luigi's dynamic
    requirements, run by this worker's processes)."""

    uses_device = False  # the join reads shard records and statistics rows only
    code_deps = ("zgcore.boundary_store",)

    def requires(self):
        deps = {"teacher": self.teacher_task(), "corpus": self.corpus_task()}
        return {**deps, "shards": self.static_shards} if self.static_shards is not None else deps

    @property
    def static_shards(self) -> list[BoundaryShard] | None:
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
        """Hash of the cache's settings, the teacher and corpus, its own code version and its shards'
        numerics (their code version and compute precision: a bf16-autocast cache is another cache),
        but not of the shard plan, which changes no byte."""
        shards = {"code_version": int(BoundaryShard.code_version), "precision": precision(self.device)}
        return config_hash(self.get_task_family(), {"config": self.own_config(), **self.numerics(), "shards": shards},
                           [self.teacher_task().uid, self.corpus_task().uid])

    def shard_tasks(self) -> list[BoundaryShard] | None:
        """The shard tasks, or None while the corpus (and so the number of sequences) is unknown."""
        meta = self.corpus_task().out_dir / "meta.json"
        if not meta.is_file():
            return None
        m = json.loads(meta.read_text())
        return [BoundaryShard(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary, split=s, lo=lo, hi=hi,
                              outputs=self.outputs, device=self.device)
                for s, lo, hi in boundary_store.plan_shards(split_sizes(m), int(self.boundary["shard_sequences"]))]

    def own_config(self):
        return {"boundary": cache_settings(self.boundary), "format_version": boundary_store.FORMAT_VERSION}

    def label(self):
        return "boundaries"

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


class TrainBlock(Resumable, _TeacherTask):
    """Train student block ``block`` (teacher layers [b_i, b_{i+1})) on boundary i → i+1.

    Its own seed, optimizer, data order and checkpoints; resumable from ``<out_dir>.partial``."""

    # 2: online targets come from load_base, which now runs each family with its own attention implementation
    code_version = 2
    code_deps = ("zgcore.train", "zgcore.loop", "zgcore.objectives", "zgcore.adapters", "zgcore.boundary_store",
                 "zgcore.device", "zgcore.teacher_weights", "zgcore.students", "zgcore.config:kept_layers",
                 "zgcore.config:resolve_boundaries")

    corpus = luigi.DictParameter(visibility=HIDDEN)
    boundary = luigi.DictParameter(visibility=HIDDEN)
    block = luigi.IntParameter()
    train = luigi.DictParameter(visibility=HIDDEN, description="this block's resolved train settings")

    def requires(self):
        req = self.data_requires()
        if students.needs_measure(self.train):
            req["importance"] = self.importance_task()
        return req

    def data_requires(self):
        """Where the block's inputs and targets come from: the boundary store (cached) or the
        teacher and the corpus (online)."""
        if self.train["targets"] == "online":  # no cache: the teacher runs inside training
            return {"teacher": self.teacher_task(),
                    "corpus": PrepareCorpus(teacher=self.teacher, corpus=self.corpus, outputs=self.outputs)}
        return {"teacher": self.teacher_task(),  # its record is read to load the teacher's layers
                "cache": TeacherBoundary(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary,
                                         outputs=self.outputs, device=self.device)}

    def importance_task(self):
        """The teacher's layer and channel measurements (keep="importance", intermediate_size)."""
        from .students import layer_importance

        return layer_importance(self, self.train)

    def own_config(self):
        t = ztrain.effective_train(canonical(self.train))  # only what can change the result is hashed
        t["boundary"] = cache_settings(self.boundary) if t["targets"] == "online" else None
        return {"block": self.block, "train": t}

    def label(self):
        return f"block{self.block}-{self.train['objective']}-{self.train['targets']}-s{self.train['seed']}"

    def run(self):
        from zgcore.device import resolve
        from zgcore.teacher_weights import layer_source, load_base

        rss = PeakRSS().start()  # this task's peak resident memory (the distillation study reports it)
        rec = teacher_record(self.teacher_task())
        bs = resolve_boundaries(self.boundary, rec["n_layers"])
        start, end = bs[self.block], bs[self.block + 1]
        measured = (json.loads((self.importance_task().out_dir / "importance.json").read_text())
                    if students.needs_measure(self.train) else {})
        kept = kept_layers(start, end, self.train, measured.get("influence"))
        seed = ztrain.block_seed(int(self.train["seed"]), self.block)
        # the teacher's config and only the kept layers' weights, read lazily (safetensors)
        block = build_block(layer_source(rec), kept, self.train["init"], seed, device=resolve(self.device),
                            intermediate_size=self.train.get("intermediate_size"), channels=measured.get("channels"))
        init_sd = {k: v.clone() for k, v in block.layer_state_dict().items()}  # training updates in place
        aux = ztrain.aux_active(self.train)  # local auxiliary terms: the teacher's head and the token ids
        tokens = head = None
        if self.train["targets"] == "online" or aux:  # the token store's train split, in the boundary store's order
            tokens = corpus.read_tokens(PrepareCorpus(teacher=self.teacher, corpus=self.corpus, outputs=self.outputs)
                                        .out_dir / "tokens.h5", "train")
        if aux:  # the teacher's final norm and LM head (its decoder layers are dropped at once)
            head = head_only(zteacher.load(rec, self.device)[0])
        if self.train["targets"] == "online":  # the teacher up to this block's output boundary only
            teacher = load_base(rec, end, self.boundary["teacher_dtype"], self.device)
            source = boundary_store.OnlineBoundaries(teacher, tokens, [start, end], self.boundary["dtype"],
                                                     int(self.boundary["batch_size"]))
        else:
            source = boundary_store.BoundaryReader(self.requires()["cache"].out_dir)
        with source:
            m = ztrain.train_block(block, source, start, end, self.train, seed, self.work_dir, self.uid,
                                   progress=lambda s, n, l: self.progress(s, n, f"step {s}/{n} loss {l:.4f}"),
                                   name=f"{self.get_task_family()} {self.label()}",
                                   head=(lambda h: head_logits(head, h)) if aux else None, tokens=tokens)
            m["teacher_seconds"] = getattr(source, "teacher_seconds", 0.0)
        with self.building() as tmp:
            ztrain.save_weights(tmp / "block.safetensors", block.layer_state_dict())
            ztrain.save_weights(tmp / "init.safetensors", init_sd)
            self.keep_work(tmp, (ztrain.LOSS_LOG, ztrain.FINAL_STATE))
            write_json(tmp / "metrics.json", {**m, "block": self.block, "start": start, "end": end, "kept": kept,
                                              "objective": self.train["objective"], "targets": self.train["targets"],
                                              "seed": seed, "keep": self.train["keep"], "intermediate_size": block.width,
                                              "influence": [measured["influence"][i] for i in range(start, end)]
                                              if measured else None, "peak_rss_mib": rss.stop()})
        self.drop_work()
        self.log(f"trained {m['steps']} steps in {m['seconds']:.1f} s; final loss {m['final_loss']:.4f}")


def load_blocks(model, blocks: list[TrainBlock], which: str = "block"):
    """Rebuild the student blocks of ``blocks`` (finished TrainBlock tasks) from their
    ``<which>.safetensors`` (``block`` = trained, ``init`` = untrained)."""
    from safetensors.torch import load_file

    out = []
    for t in blocks:
        meta = json.loads((t.out_dir / "metrics.json").read_text())
        b = build_block(model, meta["kept"], "random", 0, intermediate_size=meta.get("intermediate_size"))
        b.load_layer_state_dict(load_file(str(t.out_dir / f"{which}.safetensors")))
        out.append(b)
    return out


class _StudentTask(_TeacherTask):
    corpus = luigi.DictParameter(visibility=HIDDEN)
    boundary = luigi.DictParameter(visibility=HIDDEN)
    blocks = luigi.ListParameter(visibility=HIDDEN, description="each block's resolved train settings, in block order")

    def block_tasks(self) -> list[TrainBlock]:
        return [TrainBlock(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary, block=i, train=t,
                           outputs=self.outputs, device=self.device) for i, t in enumerate(self.blocks)]


class Assemble(_StudentTask):
    """Stitch the teacher's embedding, the trained blocks in order, and the teacher's final norm and
    LM head into one Hugging Face model folder (config, safetensors, tokenizer)."""

    code_deps = ("zgcore.adapters", "zgcore.teacher:load", "tasks.pipeline:load_blocks")

    def requires(self):
        return {"teacher": self.teacher_task(), "blocks": self.block_tasks()}

    def own_config(self):
        return {}

    def label(self):
        return "student"

    def run(self):
        rec, (model, tok) = self.load_teacher()
        student = assemble(model, load_blocks(model, self.requires()["blocks"], "block"))
        with self.building() as tmp:
            student.save_pretrained(tmp / "model")
            tok.save_pretrained(tmp / "model")
        self.log(f"saved {self.out_dir / 'model'}")


class Evaluate(_StudentTask):
    """Held-out cross-entropy of the teacher, the untrained student and the assembled student;
    writes ``report.json`` and ``report.md`` (assembled by :mod:`zgcore.report`)."""

    code_deps = ("zgcore.metrics", "zgcore.report", "zgcore.markdown", "zgcore.plots", "zgcore.adapters",
                 "zgcore.teacher:load", "tasks.pipeline:load_blocks")

    eval = luigi.DictParameter(visibility=HIDDEN)
    name = luigi.Parameter(default="experiment", significant=False)
    heal = luigi.DictParameter(default={"steps": 0}, visibility=HIDDEN,
                               description="heal section; steps > 0 evaluates the healed student (tasks.distill.Heal)")

    def requires(self):
        kw = dict(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary, blocks=self.blocks,
                  outputs=self.outputs, device=self.device)
        if int(self.heal.get("steps", 0)):
            from .distill import Heal  # the healed student takes the assembled one's place

            student = Heal(heal=self.heal, **kw)
        else:
            student = Assemble(**kw)
        req = {"teacher": self.teacher_task(), "assemble": student,
               "corpus": PrepareCorpus(teacher=self.teacher, corpus=self.corpus, outputs=self.outputs),
               "blocks": self.block_tasks()}  # metrics.json, init/block weights and loss logs are read here
        if any(t["targets"] == "cached" for t in self.blocks):  # its manifest feeds the cache economics
            req["cache"] = TeacherBoundary(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary,
                                           outputs=self.outputs, device=self.device)
        return req

    def own_config(self):
        return {"eval": self.eval}

    def label(self):
        return "report"

    def run(self):
        import torch
        from transformers import AutoModelForCausalLM

        req = self.requires()
        rec, (teacher, tok) = self.load_teacher()
        val = corpus.read_tokens(req["corpus"].out_dir / "tokens.h5", "val")
        if int(self.eval["max_sequences"]):
            val = val[: int(self.eval["max_sequences"])]
        model_dir = req["assemble"].out_dir / "model"
        student = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device)
        untrained = assemble(teacher, load_blocks(teacher, req["blocks"], "init"))
        models = (("teacher", teacher), ("untrained", untrained), ("student", student))
        ce, cu = metrics.held_out(models, val, self.eval, self.progress)
        ids = tok("The", return_tensors="pt").input_ids.to(self.device)
        sample = tok.decode(student.generate(ids, max_new_tokens=24, do_sample=False)[0], skip_special_tokens=True)
        blocks = [json.loads((t.out_dir / "metrics.json").read_text()) for t in req["blocks"]]
        bounds = [b["start"] for b in blocks] + [blocks[-1]["end"]]
        n_shift = min(int(self.eval["context_sequences"]) or 4, len(val))
        report = zreport.experiment_report(
            {"name": self.name, "teacher": self.teacher, "boundaries": bounds, "seq_len": int(val.shape[1]),
             "val_sequences": int(len(val)), "val_tokens": int(val.size), "cross_entropy": ce,
             "layers": {k: m.config.get_text_config().num_hidden_layers for k, m in models},
             "blocks": blocks, "model_dir": str(model_dir), "sample": sample, "context_use": cu,
             "heal_steps": int(self.heal.get("steps", 0)),
             "context_window": int(self.eval["context_window"]), "context_sequences": min(int(self.eval["context_sequences"]), len(val)),
             "shift": metrics.boundary_shift(teacher, load_blocks(teacher, req["blocks"], "block"), bounds, val[:n_shift])},
            self.eval)
        if "cache" in req:
            manifest = json.loads((req["cache"].out_dir / "manifest.json").read_text())
            report["economics"] = zreport.economics(manifest, blocks, [t["batch_size"] for t in self.blocks],
                                                    lambda s, e, b: metrics.teacher_forward_seconds(teacher, val, s, e, b))
        with self.building() as tmp:
            write_json(tmp / "report.json", report)
            write_text(tmp / "report.md", zreport.report_markdown(report))
            plots.loss_curves([(f"block {t.block}", t.out_dir / "loss_log.csv") for t in req["blocks"]], tmp / "loss_curves.png")
            plots.drift(report["shift"], tmp / "drift.png")
        print(f"\nReport: {self.out_dir / 'report.md'}\n{zreport.summary_line(report)}", flush=True)
