"""TrainBlock: one student block trained on its boundary pair (cached or online), and
:func:`load_blocks`, which rebuilds finished blocks from their weights.

No edge joins two TrainBlocks: each reads only the boundary store (or the teacher, online).
"""
from __future__ import annotations

import json

import luigi

from zgcore import boundary_store, corpus, students, teacher as zteacher, train as ztrain
from zgcore.adapters import build_block, head_logits, head_only
from zgcore.atomic import write_json
from zgcore.config import kept_layers, resolve_boundaries
from zgcore.hashing import canonical
from zgcore.memory import PeakRSS

from .base import HIDDEN
from .cache import TeacherBoundary, cache_settings
from .teacher import PrepareCorpus, _TeacherTask, teacher_record
from .work import Resumable


class TrainBlock(Resumable, _TeacherTask):
    """Train student block ``block`` (teacher layers [b_i, b_{i+1})) on boundary i → i+1.

    Its own seed, optimizer, data order and checkpoints; resumable from ``<out_dir>.partial``."""

    # 2: online targets come from load_base, which now runs each family with its own attention implementation
    code_version = 2
    code_deps = ("zgcore.train", "zgcore.loop", "zgcore.objectives", "zgcore.adapters", "zgcore.boundary_store",
                 "zgcore.device", "zgcore.teacher_weights", "zgcore.students", "zgcore.channels", "zgcore.config:kept_layers",
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
