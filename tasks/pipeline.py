"""The experiment graph: PrepareTeacher → PrepareCorpus → TeacherBoundary → TrainBlock(i) → Assemble → Evaluate.

No edge joins two TrainBlocks: each reads only the boundary store.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import luigi

from zgcore import boundary_store, corpus, metrics, plots, teacher as zteacher, train as ztrain
from zgcore.adapters import assemble, build_block, head_logits, head_only
from zgcore.atomic import write_json, write_text
from zgcore.config import corpus_files, kept_layers, resolve_boundaries
from zgcore.distill import PeakRSS
from zgcore.hashing import canonical

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

    corpus = luigi.DictParameter(visibility=HIDDEN)

    def requires(self):
        return self.teacher_task()

    def own_config(self):
        src = self.corpus["source"]
        stamps = None if src == "pydoc" else [path_stamp(str(f)) for f in corpus_files(self.corpus)]
        return {"corpus": self.corpus, "stamps": stamps}

    def label(self):
        return f"corpus-T{self.corpus['seq_len']}"

    def run(self):
        from transformers import AutoTokenizer

        rec = teacher_record(self.teacher_task())
        kw = {"gguf_file": rec["gguf_file"]} if rec.get("gguf_file") else {}
        tok = AutoTokenizer.from_pretrained(rec["path"], **kw)
        with self.building() as tmp:
            meta = corpus.build_token_store(tmp / "tokens.h5", self.corpus, tok, rec["spec"], rec["max_positions"])
            write_json(tmp / "meta.json", meta)
        self.log(f"{meta['tokens']} tokens -> {meta['n_train']} train + {meta['n_val']} val sequences of {meta['seq_len']}")


class TeacherBoundary(_TeacherTask):
    """Run the frozen teacher once over train and val sequences and store the raw residual stream
    at every boundary (one HDF5 dataset per boundary, chunked by sequence, with a manifest)."""

    corpus = luigi.DictParameter(visibility=HIDDEN)
    boundary = luigi.DictParameter(visibility=HIDDEN)

    def requires(self):
        return {"teacher": self.teacher_task(),
                "corpus": PrepareCorpus(teacher=self.teacher, corpus=self.corpus, outputs=self.outputs)}

    def own_config(self):
        return {"boundary": self.boundary, "format_version": boundary_store.FORMAT_VERSION}

    def label(self):
        return "boundaries"

    def verify(self):
        man = self.out_dir / "manifest.json"
        h5 = self.out_dir / "boundaries.h5"
        if not man.is_file() or not h5.is_file():
            return "boundaries.h5 or manifest.json missing"
        want = json.loads(man.read_text()).get("bytes")
        if h5.stat().st_size != want:
            return f"boundaries.h5 has {h5.stat().st_size} bytes, the manifest says {want}"
        return None

    def run(self):
        rss = PeakRSS().start()
        rec, (model, _tok) = self.load_teacher()
        bs = resolve_boundaries(self.boundary, rec["n_layers"])
        tok_path = self.requires()["corpus"].out_dir / "tokens.h5"
        tok_meta = corpus.read_meta(tok_path)
        tokens = {s: corpus.read_tokens(tok_path, s) for s in ("train", "val")}
        t0 = time.perf_counter()
        with self.building() as tmp:
            manifest = boundary_store.write_store(
                tmp / "boundaries.h5", model, tokens, bs, self.boundary["dtype"], int(self.boundary["batch_size"]),
                {"teacher_fingerprint": rec["fingerprint"], "tokenizer": tok_meta["tokenizer"],
                 "corpus_fingerprint": tok_meta["fingerprint"]},
                progress=lambda d, n: self.progress(d, n, f"teacher forward {d}/{n} sequences"), log=self.log)
            seconds = time.perf_counter() - t0
            write_json(tmp / "manifest.json", {**manifest, "build_seconds": seconds, "peak_rss_mib": rss.stop(),
                                              "bytes": (tmp / "boundaries.h5").stat().st_size})
        self.log(f"built in {seconds:.1f} s")


class TrainBlock(Resumable, _TeacherTask):
    """Train student block ``block`` (teacher layers [b_i, b_{i+1})) on boundary i → i+1.

    Its own seed, optimizer, data order and checkpoints; resumable from ``<out_dir>.partial``."""

    corpus = luigi.DictParameter(visibility=HIDDEN)
    boundary = luigi.DictParameter(visibility=HIDDEN)
    block = luigi.IntParameter()
    train = luigi.DictParameter(visibility=HIDDEN, description="this block's resolved train settings")

    def requires(self):
        if self.train["targets"] == "online":  # no cache: the teacher runs inside training
            return {"teacher": self.teacher_task(),
                    "corpus": PrepareCorpus(teacher=self.teacher, corpus=self.corpus, outputs=self.outputs)}
        return TeacherBoundary(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary, outputs=self.outputs,
                               device=self.device)

    def own_config(self):
        t = ztrain.effective_train(canonical(self.train))  # only what can change the result is hashed
        t["boundary"] = canonical(self.boundary) if t["targets"] == "online" else None
        return {"block": self.block, "train": t}

    def label(self):
        return f"block{self.block}-{self.train['objective']}-{self.train['targets']}-s{self.train['seed']}"

    def run(self):
        rss = PeakRSS().start()  # this task's peak resident memory (the distillation study reports it)
        rec, (model, _tok) = self.load_teacher()
        bs = resolve_boundaries(self.boundary, rec["n_layers"])
        start, end = bs[self.block], bs[self.block + 1]
        kept = kept_layers(start, end, self.train)
        seed = ztrain.block_seed(int(self.train["seed"]), self.block)
        block = build_block(model, kept, self.train["init"], seed)
        init_sd = {k: v.clone() for k, v in block.layer_state_dict().items()}  # training updates in place
        aux = ztrain.aux_active(self.train)  # local auxiliary terms: the teacher's head and the token ids
        tokens = None
        if self.train["targets"] == "online" or aux:  # the token store's train split, in the boundary store's order
            tokens = corpus.read_tokens(PrepareCorpus(teacher=self.teacher, corpus=self.corpus, outputs=self.outputs)
                                        .out_dir / "tokens.h5", "train")
        head = (model.requires_grad_(False) if self.train["targets"] == "online" else head_only(model)) if aux else None
        if self.train["targets"] == "online":
            source = boundary_store.OnlineBoundaries(model, tokens, [start, end], self.boundary["dtype"],
                                                     int(self.boundary["batch_size"]))
        else:
            del model
            source = boundary_store.BoundaryReader(self.requires().out_dir / "boundaries.h5")
        with source:
            m = ztrain.train_block(block, source, start, end, self.train, seed, self.work_dir, self.uid,
                                   progress=lambda s, n, l: self.progress(s, n, f"step {s}/{n} loss {l:.4f}"),
                                   name=f"{self.get_task_family()} {self.label()}",
                                   head=(lambda h: head_logits(head, h)) if aux else None, tokens=tokens)
            m["teacher_seconds"] = getattr(source, "teacher_seconds", 0.0)
        with self.building() as tmp:
            ztrain.save_weights(tmp / "block.safetensors", block.layer_state_dict())
            ztrain.save_weights(tmp / "init.safetensors", init_sd)
            for name in ("loss_log.csv", ztrain.FINAL_STATE):
                os.replace(self.work_dir / name, tmp / name)
            write_json(tmp / "metrics.json", {**m, "block": self.block, "start": start, "end": end, "kept": kept,
                                              "objective": self.train["objective"], "targets": self.train["targets"],
                                              "seed": seed, "peak_rss_mib": rss.stop()})
        import shutil

        shutil.rmtree(self.work_dir, ignore_errors=True)
        self.log(f"trained {m['steps']} steps in {m['seconds']:.1f} s; final loss {m['final_loss']:.4f}")


def load_blocks(model, blocks: list[TrainBlock], which: str = "block"):
    """Rebuild the student blocks of ``blocks`` (finished TrainBlock tasks) from their
    ``<which>.safetensors`` (``block`` = trained, ``init`` = untrained)."""
    from safetensors.torch import load_file

    out = []
    for t in blocks:
        meta = json.loads((t.out_dir / "metrics.json").read_text())
        b = build_block(model, meta["kept"], "teacher", 0)
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

    def requires(self):
        return self.block_tasks()

    def own_config(self):
        return {}

    def label(self):
        return "student"

    def run(self):
        rec, (model, tok) = self.load_teacher()
        student = assemble(model, load_blocks(model, self.requires(), "block"))
        with self.building() as tmp:
            student.save_pretrained(tmp / "model")
            tok.save_pretrained(tmp / "model")
        self.log(f"saved {self.out_dir / 'model'}")


class Evaluate(_StudentTask):
    """Held-out cross-entropy of the teacher, the untrained student and the assembled student;
    writes ``report.json`` and ``report.md``."""

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
        return {"assemble": student, "corpus": PrepareCorpus(teacher=self.teacher, corpus=self.corpus, outputs=self.outputs)}

    def own_config(self):
        return {"eval": self.eval}

    def label(self):
        return "report"

    def economics(self, teacher, tokens, blocks: list[dict]) -> dict | None:
        """Cache economics from measured times: the cache build (manifest), each block job's wall
        time, and — for the mode a block did not run in — the job projected from its measured
        compute time plus (online) the teacher time per batch timed here, or (cached) the
        measured data time of reading a batch from the store."""
        import numpy as np
        import torch
        from zgcore.adapters import capture_boundaries

        manifest_path = TeacherBoundary(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary,
                                        outputs=self.outputs).out_dir / "manifest.json"
        if not manifest_path.is_file():
            return None
        man = json.loads(manifest_path.read_text())
        n_seq = man["n_train"] + man["n_val"]
        jobs = []
        timed: dict[tuple[int, int], float] = {}
        for b in blocks:
            bsz = int(self.blocks[b["block"]]["batch_size"])
            key = (b["end"], bsz)
            if key not in timed:
                ids = torch.as_tensor(np.resize(tokens, (bsz, tokens.shape[1])), dtype=torch.long, device=self.device)
                capture_boundaries(teacher, ids, [b["start"], b["end"]])  # warm-up
                t0 = time.perf_counter()
                for _ in range(2):
                    capture_boundaries(teacher, ids, [b["start"], b["end"]])
                timed[key] = (time.perf_counter() - t0) / 2
            if b["targets"] == "online":
                online, teacher_s = b["seconds"], b["teacher_seconds"]
                cached = b["compute_seconds"] + b["data_seconds"] - teacher_s  # no measured read time: a lower bound
            else:
                cached, teacher_s = b["seconds"], b["steps"] * timed[key]
                online = b["compute_seconds"] + teacher_s
            jobs.append({"block": b["block"], "cached_seconds": cached, "online_seconds": online,
                         "data_seconds": b["data_seconds"], "compute_seconds": b["compute_seconds"],
                         "online_teacher_seconds": teacher_s, "steps": b["steps"], "measured": b["targets"]})
        econ = metrics.cache_economics(man["build_seconds"], man["bytes"], jobs)
        econ["build_seconds_per_sequence"] = man["build_seconds"] / n_seq
        econ["method"] = ("Each job's time in the mode it ran in is measured; the other mode is projected from its "
                          "measured compute time plus the teacher's forward time per batch up to the block's output "
                          "boundary, timed in this task.")
        return econ

    def run(self):
        import torch
        from transformers import AutoModelForCausalLM

        rec, (teacher, tok) = self.load_teacher()
        val = corpus.read_tokens(self.requires()["corpus"].out_dir / "tokens.h5", "val")
        if int(self.eval["max_sequences"]):
            val = val[: int(self.eval["max_sequences"])]
        bsz = int(self.eval["batch_size"])
        block_tasks = self.block_tasks()
        model_dir = self.requires()["assemble"].out_dir / "model"
        student = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device)
        untrained = assemble(teacher, load_blocks(teacher, block_tasks, "init"))
        ce, cu = {}, {}
        n_ctx = min(int(self.eval["context_sequences"]), len(val))
        models = (("teacher", teacher), ("untrained", untrained), ("student", student))
        for i, (key, m) in enumerate(models):
            self.progress(i, 3, f"held-out CE and context use: {key}")
            ce[key] = metrics.cross_entropy(m, val, bsz, desc=f"CE {key}")
            if n_ctx:
                cu[key] = metrics.context_use(m, val[:n_ctx], int(self.eval["context_window"]))
        ids = tok("The", return_tensors="pt").input_ids.to(self.device)
        sample = tok.decode(student.generate(ids, max_new_tokens=24, do_sample=False)[0], skip_special_tokens=True)
        blocks = [json.loads((t.out_dir / "metrics.json").read_text()) for t in block_tasks]
        n_layers = lambda m: m.config.num_hidden_layers if hasattr(m.config, "num_hidden_layers") else m.config.n_layer
        report = {"name": self.name, "teacher": self.teacher, "boundaries": [b["start"] for b in blocks] + [blocks[-1]["end"]],
                  "seq_len": int(val.shape[1]), "val_sequences": int(len(val)), "val_tokens": int(val.size),
                  "cross_entropy": ce, "perplexity": {k: metrics.perplexity(v) for k, v in ce.items()},
                  "gap_recovered": metrics.gap_recovered(ce["untrained"], ce["student"], ce["teacher"]),
                  "layers": {"teacher": n_layers(teacher), "untrained": n_layers(untrained), "student": n_layers(student)},
                  "blocks": blocks, "model_dir": str(model_dir), "sample": sample, "heal_steps": int(self.heal.get("steps", 0)),
                  "context_use": cu, "context_window": int(self.eval["context_window"]), "context_sequences": n_ctx}
        report["gates"] = metrics.gates(report, float(self.eval["gate_gap"]), float(self.eval["gate_context"]))
        report["economics"] = self.economics(teacher, val, blocks)
        n_shift = min(int(self.eval["context_sequences"]) or 4, len(val))
        report["shift"] = metrics.boundary_shift(teacher, load_blocks(teacher, block_tasks, "block"),
                                                 report["boundaries"], val[:n_shift])
        with self.building() as tmp:
            write_json(tmp / "report.json", report)
            write_text(tmp / "report.md", metrics.report_markdown(report))
            plots.loss_curves([(f"block {t.block}", t.out_dir / "loss_log.csv") for t in block_tasks], tmp / "loss_curves.png")
            plots.drift(report["shift"], tmp / "drift.png")
        print(f"\nReport: {self.out_dir / 'report.md'}\n"
              f"held-out CE (nats/token): teacher {ce['teacher']:.4f} | untrained student {ce['untrained']:.4f} | "
              f"assembled student {ce['student']:.4f} | gap recovered {100 * report['gap_recovered']:.1f}%", flush=True)
