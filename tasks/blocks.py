"""TrainBlock: one student block trained on its boundary pair (cached or online), and
:func:`load_blocks`, which rebuilds finished blocks from their weights.

No edge joins two TrainBlocks: each reads only the boundary store (or the teacher, online).
"""
from __future__ import annotations

import json

import luigi

from zgcore.config.experiment import effective_train
from zgcore.atomic import write_json
from zgcore.data import boundary_store, corpus
from zgcore.data.boundary_store import codec
from zgcore.evaluation import flops
from zgcore.hashing import canonical
from zgcore.models import students
from zgcore.models.adapters import build_block
from zgcore.training import blocks as ztrain
from zgcore.training.partition import PartitionJob, mixer_of, train_partition

from . import search
from .base import HIDDEN
from .cache import TeacherBoundary, cache_settings
from .teacher import PrepareCorpus, _TeacherTask, teacher_record
from .work import Resumable


class TrainBlock(Resumable, _TeacherTask):
    """Train student block ``block`` (teacher layers [b_i, b_{i+1})) on boundary i → i+1
    (:func:`zgcore.training.partition.train_partition`).

    Its own seed, optimizer, data order and checkpoints; resumable from ``<out_dir>.partial``.
    With ``train.lrs`` it searches its peak lr (:class:`tasks.search.LRSearch`, :mod:`zgcore.training.lr_search`)."""

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
            return {"teacher": self.teacher_task(), "corpus": self.shared(PrepareCorpus)}
        req = {"teacher": self.teacher_task(),  # its record is read to load the teacher's layers
               "cache": self.shared(TeacherBoundary, boundary=self.boundary, device=self.device)}
        if ztrain.aux_active(self.train):  # local CE / MTP terms read the token ids from the token store
            req["corpus"] = self.shared(PrepareCorpus)
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

    def run(self):
        """Train at ``train.lr``; with ``train.lrs``, search the lr (candidates yielded as dynamic dependencies)."""
        yield from search.LRSearch(self).run(self.train_once)

    def dynamic_upstream(self) -> list:
        return search.LRSearch(self).dynamic_upstream()

    def train_once(self):
        """Train the block at ``train.lr`` and write its output."""
        req = self.requires()
        job = PartitionJob(teacher_record(self.teacher_task()), self.boundary, self.corpus, self.train, self.block,
                           self.device, self.work_dir, self.uid, self.title(), flops.block_train_flops,
                           cache=req["cache"].out_dir if "cache" in req else None,
                           tokens=req["corpus"].out_dir / "tokens.h5" if "corpus" in req else None,
                           importance=req["importance"].out_dir / "importance.json" if "importance" in req else None,
                           progress=lambda s, n, loss: self.progress(s, n, f"step {s}/{n} loss {loss:.4f}"),
                           watchers=lambda per_token: self.watchers(self.train.get("tensorboard", True), per_token))
        trained = train_partition(job)
        with self.building() as tmp:
            self.keep_work(tmp, (ztrain.LOSS_LOG, ztrain.FINAL_STATE))
            trained.save(tmp)
        self.drop_work()
        m = trained.metrics
        self.log(f"trained {m['steps']} steps in {m['seconds']:.1f} s; final loss {m['final_loss']:.4f}")

    # -- the lr search's hooks (train.lrs; tasks.search.LRSearch)
    def candidate_task(self, lr: float) -> TrainBlock:
        """This block at one peak lr, without a search."""
        return self.shared(TrainBlock, boundary=self.boundary, block=self.block,
                           train={**dict(self.train), "lr": float(lr),
                           "lrs": []}, candidate=True, study=self.study, device=self.device)

    def score_task(self, candidate: TrainBlock) -> ScoreBlock:
        return self.shared(ScoreBlock, boundary=self.boundary, block=self.block, train=candidate.train,
                           device=self.device)

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
        return self.shared(TrainBlock, boundary=self.boundary, block=self.block, train=self.train, candidate=True,
                           study=self.study, device=self.device)

    def requires(self):
        b = self.block_task()
        req = {"block": b, **b.data_requires()}
        if self.train["targets"] == "online":
            req["corpus"] = self.shared(PrepareCorpus)
        return req

    def own_config(self):
        return {"split": "val", "outside_test": dict(self.train.get("tune") or {})}

    def label(self):
        return self.block_task().label() + "-val"

    def run(self):
        from zgcore.device import resolve
        from zgcore.models.teacher_stream import teacher_for
        from zgcore.models.teacher_weights import layer_source

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
            source = boundary_store.OnlineBoundaries(teacher_for(rec, meta["end"], self.boundary["teacher_dtype"], self.device),
                                                     val[search.tune_rows(len(val), tune, who)], [meta["start"], meta["end"]],
                                                     self.boundary["dtype"], int(self.boundary["batch_size"]),
                                                     codec.settings(self.boundary))
            rows = None  # the source holds the tuning rows only
        else:
            source = boundary_store.BoundaryReader(req["cache"].out_dir)
            rows = search.tune_rows(source.n("val"), tune, who)
        with source:
            m = ztrain.val_loss(block, source, meta["start"], meta["end"], self.train, rows=rows)
        with self.building() as tmp:
            write_json(tmp / "score.json", {**m, "lr": float(self.train["lr"])})
        self.log(f"validation loss {m['val_loss']:.4f} over {m['sequences']} sequences")


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
