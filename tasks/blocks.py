"""TrainBlock: one student block trained on its boundary pair (cached or online), and
:func:`load_blocks`, which rebuilds finished blocks from their weights.

No edge joins two TrainBlocks: each reads only the boundary store (or the teacher, online).
"""
from __future__ import annotations

import json

import luigi

from zgcore.data import boundary_store, corpus
from zgcore.evaluation import flops
from zgcore.config.experiment import effective_train
from zgcore.training import blocks as ztrain, mfu
from zgcore.models import students
from zgcore.models.adapters import build_block, head_logits
from zgcore.atomic import write_json
from zgcore.models.shapes import kept_layers, resolve_boundaries
from zgcore.hashing import canonical
from zgcore.training.memory import PeakRSS

from . import search
from .base import HIDDEN
from .cache import TeacherBoundary, cache_settings
from .teacher import PrepareCorpus, _TeacherTask, teacher_record
from .work import Resumable


class TrainBlock(search.SearchesLR, Resumable, _TeacherTask):
    """Train student block ``block`` (teacher layers [b_i, b_{i+1})) on boundary i → i+1.

    Its own seed, optimizer, data order and checkpoints; resumable from ``<out_dir>.partial``.
    With ``train.lrs`` it searches its peak lr (:mod:`zgcore.training.lr_search`; see :meth:`run`)."""

    # 2: online targets come from load_base, which now runs each family with its own attention implementation
    code_version = 2

    corpus = luigi.DictParameter(visibility=HIDDEN)
    boundary = luigi.DictParameter(visibility=HIDDEN)
    block = luigi.IntParameter()
    train = luigi.DictParameter(visibility=HIDDEN, description="this block's resolved train settings")
    candidate = luigi.BoolParameter(default=False, significant=False,
                                    description="a candidate of an lr search: a divergence is recorded, not raised")

    def requires(self):
        req = self.data_requires()
        if students.needs_measure(self.train):
            req["importance"] = self.importance_task()
        return req

    def data_requires(self):
        """Where the block's inputs and targets come from: the boundary store (cached) or the
        teacher and the corpus (online); with local auxiliary terms also the token store."""
        if self.train["targets"] == "online":  # no cache: the teacher runs inside training
            return {"teacher": self.teacher_task(),
                    "corpus": PrepareCorpus(teacher=self.teacher, corpus=self.corpus, outputs=self.outputs)}
        req = {"teacher": self.teacher_task(),  # its record is read to load the teacher's layers
               "cache": TeacherBoundary(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary,
                                        outputs=self.outputs, device=self.device)}
        if ztrain.aux_active(self.train):  # local CE / MTP terms read the token ids from the token store
            req["corpus"] = PrepareCorpus(teacher=self.teacher, corpus=self.corpus, outputs=self.outputs)
        return req

    def importance_task(self):
        """The teacher's layer and channel measurements (keep="importance", intermediate_size)."""
        from .students import layer_importance

        return layer_importance(self, self.train)

    def own_config(self):
        t = effective_train(canonical(self.train))  # only what can change the result is hashed
        t["boundary"] = cache_settings(self.boundary) if t["targets"] == "online" else None
        return {"block": self.block, "train": t}

    def label(self):
        lr = "-lrs" if self.train.get("lrs") else f"-lr{float(self.train['lr']):g}" if self.candidate else ""
        mixer = f"-{self.train['mixer']}" if self.train.get("mixer", "softmax") != "softmax" else ""  # a converted block
        return f"block{self.block}{mixer}-{self.train['objective']}-{self.train['targets']}-s{self.train['seed']}{lr}"

    # -- the lr search (train.lrs)
    def candidate_task(self, lr: float) -> "TrainBlock":
        """This block at one peak lr, without a search."""
        return TrainBlock(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary, block=self.block,
                          train={**dict(self.train), "lr": float(lr), "lrs": []}, candidate=True,
                          study=self.study, outputs=self.outputs, device=self.device)

    def score_task(self, candidate: "TrainBlock") -> "ScoreBlock":
        return ScoreBlock(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary, block=self.block,
                          train=candidate.train, outputs=self.outputs, device=self.device)

    def score_of(self, task) -> dict:
        e = json.loads((task.out_dir / "score.json").read_text())
        return {"score": e["val_loss"], "diverged": e.get("diverged")}

    def search_hint(self) -> str:
        return f"lower train.lrs (or blocks.{self.block}.lrs)"

    def keep_chosen(self, best, tmp, s, record) -> None:
        search.copy_output(best.out_dir, tmp, ("block.safetensors", "init.safetensors", ztrain.LOSS_LOG, ztrain.FINAL_STATE))
        # the chosen candidate's metrics, with the lr and its search (an experiment's report carries them)
        m = json.loads((best.out_dir / "metrics.json").read_text())
        write_json(tmp / "metrics.json", {**m, "lr": s["best_lr"], "lr_search": record})
        write_json(tmp / "search.json", record)

    def check_tune_rows(self) -> None:
        """Before any candidate trains: the validation split has sequences outside the test
        subset to score the candidates on (else ``ValueError`` saying what to set)."""
        req = self.data_requires()
        if "cache" in req:
            n_val = int(json.loads((req["cache"].out_dir / boundary_store.MANIFEST).read_text())["n_val"])
        else:
            n_val = int(corpus.read_meta(req["corpus"].out_dir / "tokens.h5")["n_val"])
        search.tune_rows(n_val, dict(self.train.get("tune") or {}), f"train.lrs (block {self.block})")

    def train_once(self):
        """Train the block at ``train.lr`` and write its output."""
        from zgcore.device import resolve
        from zgcore.models.teacher_weights import layer_source, load_base, load_head

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
                            intermediate_size=self.train.get("intermediate_size"), channels=measured.get("channels"),
                            kv_heads=self.train.get("kv_heads"), **mixer_of(self.train))
        init_sd = {k: v.clone() for k, v in block.layer_state_dict().items()}  # training updates in place
        aux = ztrain.aux_active(self.train)  # local auxiliary terms: the teacher's head and the token ids
        tokens = head = None
        if self.train["targets"] == "online" or aux:  # the token store's train split, in the boundary store's order
            tokens = corpus.read_tokens(self.requires()["corpus"].out_dir / "tokens.h5", "train")
        if aux:  # the teacher's embedding, final norm and LM head only: no decoder layer is read
            head = load_head(rec, self.device)
        if self.train["targets"] == "online":  # the teacher up to this block's output boundary only
            teacher = load_base(rec, end, self.boundary["teacher_dtype"], self.device)
            source = boundary_store.OnlineBoundaries(teacher, tokens, [start, end], self.boundary["dtype"],
                                                     int(self.boundary["batch_size"]))
        else:
            source = boundary_store.BoundaryReader(self.requires()["cache"].out_dir)
        seq_len, width = int(self.corpus["seq_len"]), block.body.config.hidden_size
        layer_params = [sum(p.numel() for p in layer.parameters()) for layer in block.layers]
        per_token = flops.block_train_flops(layer_params, width, seq_len, 1, 1) / seq_len  # training FLOPs per token
        transfer = None
        if self.train["objective"] == "attention_transfer":  # the partition's own teacher layers, read lazily
            from zgcore.training.transfer import AttentionTargets, transfer_loss

            targets = AttentionTargets(build_block(layer_source(rec), list(range(start, end)), "teacher", 0,
                                                   device=resolve(self.device)), start, kept)
            transfer = lambda x: transfer_loss(block, targets, x)  # noqa: E731
        with source:
            m = ztrain.train_block(block, source, start, end, self.train, seed, self.work_dir, self.uid, transfer=transfer,
                                   progress=lambda s, n, l: self.progress(s, n, f"step {s}/{n} loss {l:.4f}"),
                                   name=self.title(),
                                   head=(lambda h: head_logits(head, h)) if aux else None, tokens=tokens,
                                   callbacks=self.watchers(self.train.get("tensorboard", True), per_token))
            m["teacher_seconds"] = getattr(source, "teacher_seconds", 0.0)
        # the block's training FLOPs against this process's matmul peak (the report's utilisation table)
        m.update(mfu.utilisation(flops.block_train_flops(layer_params, width, seq_len, m["steps"],
                                                         int(self.train["batch_size"])), m["seconds"], self.device))
        with self.building() as tmp:
            ztrain.save_weights(tmp / "block.safetensors", block.layer_state_dict())
            ztrain.save_weights(tmp / "init.safetensors", init_sd)
            self.keep_work(tmp, (ztrain.LOSS_LOG, ztrain.FINAL_STATE))
            write_json(tmp / "metrics.json", {**m, "block": self.block, "start": start, "end": end, "kept": kept,
                                              "objective": self.train["objective"], "targets": self.train["targets"],
                                              "seed": seed, "keep": self.train["keep"], "intermediate_size": block.width,
                                              **({"kv_heads": block.kv_heads} if block.kv_heads is not None else {}),
                                              **mixer_of(self.train),
                                              "influence": [measured["influence"][i] for i in range(start, end)]
                                              if measured else None, "peak_rss_mib": rss.stop()})
        self.drop_work()
        self.log(f"trained {m['steps']} steps in {m['seconds']:.1f} s; final loss {m['final_loss']:.4f}")


class ScoreBlock(_TeacherTask):
    """The validation loss of one trained candidate block of an lr search
    (:func:`zgcore.training.blocks.val_loss`: the block's regression loss on the boundary store's validation
    split, or, with online targets, on the teacher's boundaries of the validation tokens), over
    the validation sequences outside the test subset (``train.tune``, :func:`zgcore.evaluation.metrics.tune_subset`:
    no lr is chosen on the sequences the CE is reported on); writes ``score.json``
    ``{"val_loss", "sequences"}`` or, for a diverged candidate, ``{"val_loss": null, "diverged": {...}}``."""

    # 2: scored on the validation sequences outside the test subset (was: every one)
    code_version = 2

    corpus = luigi.DictParameter(visibility=HIDDEN)
    boundary = luigi.DictParameter(visibility=HIDDEN)
    block = luigi.IntParameter()
    train = luigi.DictParameter(visibility=HIDDEN, description="the candidate's train settings (one lr, no lrs)")

    def block_task(self) -> TrainBlock:
        return TrainBlock(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary, block=self.block,
                          train=self.train, candidate=True, study=self.study, outputs=self.outputs, device=self.device)

    def requires(self):
        b = self.block_task()
        req = {"block": b, **b.data_requires()}
        if self.train["targets"] == "online":
            req["corpus"] = PrepareCorpus(teacher=self.teacher, corpus=self.corpus, outputs=self.outputs)
        return req

    def own_config(self):
        return {"split": "val", "outside_test": dict(self.train.get("tune") or {})}

    def label(self):
        return self.block_task().label() + "-val"

    def run(self):
        from zgcore.device import resolve
        from zgcore.models.teacher_weights import layer_source, load_base

        req = self.requires()
        div = search.diverged(req["block"])
        if div is not None:
            with self.building() as tmp:
                write_json(tmp / "score.json", {"val_loss": None, "diverged": div})
            return
        rec = teacher_record(self.teacher_task())
        meta = json.loads((req["block"].out_dir / "metrics.json").read_text())
        (block,) = load_blocks(layer_source(rec), [req["block"]])
        block = block.to(resolve(self.device))
        tune, who = dict(self.train.get("tune") or {}), f"train.lrs (block {self.block})"
        if self.train["targets"] == "online":  # the teacher over the tuning rows only (its loss scale comes from them too)
            val = corpus.read_tokens(req["corpus"].out_dir / "tokens.h5", "val")
            source = boundary_store.OnlineBoundaries(load_base(rec, meta["end"], self.boundary["teacher_dtype"], self.device),
                                                     val[search.tune_rows(len(val), tune, who)], [meta["start"], meta["end"]],
                                                     self.boundary["dtype"], int(self.boundary["batch_size"]))
            rows = None  # the source holds the tuning rows only
        else:
            source = boundary_store.BoundaryReader(req["cache"].out_dir)
            rows = search.tune_rows(source.n("val"), tune, who)
        with source:
            m = ztrain.val_loss(block, source, meta["start"], meta["end"], self.train, rows=rows)
        with self.building() as tmp:
            write_json(tmp / "score.json", {**m, "lr": float(self.train["lr"])})
        self.log(f"validation loss {m['val_loss']:.4f} over {m['sequences']} sequences")


def mixer_of(t) -> dict:
    """``{"mixer", "window"}`` of a converted block's train settings or metrics, ``{}`` for softmax
    (whose metrics stay as they were)."""
    from zgcore.models.mixers import WINDOWED, is_converted

    if not is_converted(t):
        return {}
    return {"mixer": t["mixer"], **({"window": int(t["window"])} if t["mixer"] in WINDOWED else {})}


def load_blocks(model, blocks: list[TrainBlock], which: str = "block"):
    """Rebuild the student blocks of ``blocks`` (finished TrainBlock tasks) from their
    ``<which>.safetensors`` (``block`` = trained, ``init`` = untrained), each file's bytes checked
    against the SHA-256 recorded when it was written first.

    Raises:
        tasks.base.DamagedOutputError: a block's file differs from what was written (that block's
            folder is moved aside, so the next run retrains that block only)."""
    from safetensors.torch import load_file

    out = []
    for t in blocks:
        meta = json.loads(t.checked("metrics.json").read_text())
        b = build_block(model, meta["kept"], "random", 0, intermediate_size=meta.get("intermediate_size"),
                        kv_heads=meta.get("kv_heads"), **mixer_of(meta))
        b.load_layer_state_dict(load_file(str(t.checked(f"{which}.safetensors"))))
        out.append(b)
    return out
