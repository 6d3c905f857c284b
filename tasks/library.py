"""The library of candidate blocks: each candidate scored in context (ScoreCandidate), one choice
per budget (SelectBudget), the chosen student assembled without padding (AssembleExact) and scored
on the held-out test rows (ScoreStudent). A candidate is an ordinary ``TrainBlock``: a library
and an experiment asking for the same block share it, and no edge joins two candidates.
"""
from __future__ import annotations

import json
import math

import luigi

from zgcore.atomic import write_json
from zgcore.data import boundary_store, corpus
from zgcore.evaluation import heldout_score, metrics, selection
from zgcore.evaluation.compare import SCORES, save_scores, scores_part
from zgcore.models import costs
from zgcore.models.adapters import build_block
from zgcore.models.hetero import assemble_exact, save_student
from zgcore.training import blocks as ztrain

from . import score, search
from .assemble import _StudentTask
from .base import HIDDEN, ZGTask
from .blocks import TrainBlock, load_blocks
from .cache import TeacherBoundary
from .heldout import held_out_tasks, read_held_out
from .score import ScoreTeacher
from .teacher import PrepareCorpus, _TeacherTask

CANDIDATE = "candidate.json"
BATCH = 8  # sequences per forward when scoring on the tuning rows


def teacher_tune_score(task, tune) -> ScoreTeacher:
    """The teacher's held-out CE on the tuning rows (the validation sequences outside the test
    subset ``tune``): the reference every candidate's in-context CE is measured against, the same
    :class:`tasks.score.ScoreTeacher` task for every library on one outputs folder."""
    return task.shared(ScoreTeacher, rows="tune", device=task.device,
                       eval={"batch_size": BATCH, "max_sequences": int(tune["max_sequences"]),
                             "subset_seed": int(tune["subset_seed"])})


def score_mean(task: ScoreTeacher) -> float:
    """A finished scoring task's mean held-out CE (nats/token): the mean of its per-sequence CE."""
    import numpy as np

    d = json.loads(task.checked(score.SCORES).read_text())
    return float(np.asarray(d["ce"][task.key], dtype=np.float64).mean())


class ScoreCandidate(_TeacherTask):
    """One trained candidate block in context: the teacher with partition ``block``'s layers
    replaced by it, its held-out cross-entropy (nats/token) on the tuning rows (the validation
    sequences outside the test subset, :func:`zgcore.evaluation.metrics.tune_subset`) minus the
    teacher's there; its block loss on the same rows (cached targets; None online); and its cost
    (:func:`zgcore.models.costs.block_cost` at ``corpus.seq_len``). Writes ``candidate.json``."""

    corpus = luigi.DictParameter(visibility=HIDDEN)
    boundary = luigi.DictParameter(visibility=HIDDEN)
    block = luigi.IntParameter()
    train = luigi.DictParameter(visibility=HIDDEN, description="the candidate's resolved train settings")
    tune = luigi.DictParameter(visibility=HIDDEN, description="the test subset's settings {max_sequences, subset_seed}")
    context = luigi.IntParameter(default=0, description="library.context: decode tokens at which kv_bytes are counted")

    def block_task(self) -> TrainBlock:
        return self.shared(TrainBlock, boundary=self.boundary, block=self.block, train=self.train, study=self.study,
                           device=self.device)

    def requires(self):
        req = {"block": self.block_task(), "teacher": self.teacher_task(),
               "corpus": self.shared(PrepareCorpus),
               "teacher_ce": teacher_tune_score(self, self.tune)}
        if self.train["targets"] == "cached":
            req["cache"] = self.shared(TeacherBoundary, boundary=self.boundary, device=self.device)
        return req

    def own_config(self):
        return {"tune": dict(self.tune), **({"context": int(self.context)} if int(self.context) else {})}

    def label(self):
        return f"{self.block_task().label()}-context"

    def run(self):
        req = self.requires()
        rec, (teacher, _tok) = self.load_teacher()
        meta = json.loads((req["block"].out_dir / "metrics.json").read_text())
        start, end, n = meta["start"], meta["end"], rec["n_layers"]
        (cand,) = load_blocks(teacher, [req["block"]])
        cand = cand.to(next(teacher.parameters()).device)
        parts = ([build_block(teacher, range(start), "teacher", 0)] if start > 0 else []) + [cand] + \
                ([build_block(teacher, range(end, n), "teacher", 0)] if end < n else [])
        model = assemble_exact(teacher, parts)
        val = corpus.read_tokens(req["corpus"].out_dir / "tokens.h5", "val")
        rows = search.tune_rows(len(val), dict(self.tune), f"the library's candidate scores (block {self.block})")
        ce_teacher = score_mean(req["teacher_ce"])
        ce = metrics.cross_entropy(model, val[rows], BATCH, desc=f"CE candidate {self.label()}")
        block_loss = None
        if "cache" in req:
            with boundary_store.BoundaryReader(req["cache"].out_dir) as source:
                block_loss = ztrain.val_loss(cand, source, start, end, self.train, rows=rows)["val_loss"]
        if not (math.isfinite(ce) and math.isfinite(ce_teacher)):
            raise ValueError(f"candidate {self.label()}: held-out CE is not finite ({ce}, teacher {ce_teacher})")
        width = meta.get("intermediate_size")
        cost = costs.block_cost(teacher.config, meta["kept"], width, meta.get("kv_heads"), int(self.corpus["seq_len"]),
                                meta.get("mixer", "softmax"), meta.get("window"), int(self.context))
        with self.building() as tmp:
            write_json(tmp / CANDIDATE, {"block": self.block, "start": start, "end": end, "kept": meta["kept"],
                                         "intermediate_size": width, "kv_heads": meta.get("kv_heads"),
                                         "ce": ce, "ce_teacher": ce_teacher, "ce_increase": ce - ce_teacher,
                                         "block_loss": block_loss, "tune_sequences": len(rows), **cost,
                                         "student_extra": costs.student_extra(teacher.config),
                                         "block_dir": str(req["block"].out_dir)})
        self.log(f"CE {ce:.4f} vs teacher {ce_teacher:.4f} ({ce - ce_teacher:+.4f} nats/token); "
                 f"{cost['params']:,} params")


def read_candidate(task: ScoreCandidate) -> dict:
    """A finished ScoreCandidate's ``candidate.json``."""
    return json.loads((task.out_dir / CANDIDATE).read_text())


class SelectBudget(ZGTask):
    """One variant per partition minimising the summed in-context CE increase under one budget:
    the multiple-choice knapsack of :func:`zgcore.evaluation.selection.select`. Writes
    ``selection.json`` ``{"budget", "unit", "chosen" (variant index per partition), "delta",
    "cost", "params", "flops", "kv_bytes"}`` (whole-student costs: blocks plus the final norm / head)."""

    uses_device = False
    candidates = luigi.ListParameter(visibility=HIDDEN, description="per partition, its ScoreCandidate tasks' parameters")
    budget = luigi.FloatParameter(description="the budget in unit's absolute terms")
    unit = luigi.Parameter(default="params", description="params | flops | kv_bytes")

    def requires(self):
        return [[ScoreCandidate(**c) for c in part] for part in self.candidates]

    def own_config(self):
        return {"budget": float(self.budget), "unit": self.unit}

    def label(self):
        b = float(self.budget)
        return f"select-{self.unit}{int(round(b)) if b >= 1 else format(b, 'g')}"  # never scientific notation

    def run(self):
        cands = [[read_candidate(t) for t in part] for part in self.requires()]
        extra = cands[0][0]["student_extra"]
        deltas = [[c["ce_increase"] for c in part] for part in cands]
        unit_costs = [[c[self.unit] for c in part] for part in cands]
        s = selection.select(deltas, unit_costs, float(self.budget) - extra[self.unit])
        total = {u: extra[u] + sum(cands[i][v][u] for i, v in enumerate(s["chosen"])) for u in costs.UNITS}
        with self.building() as tmp:
            write_json(tmp / "selection.json", {"budget": float(self.budget), "unit": self.unit, "chosen": s["chosen"],
                                                "delta": s["delta"], "cost": total[self.unit], **total})
        self.log(f"budget {self.budget:,.0f} {self.unit}: variants {s['chosen']}, summed CE increase {s['delta']:.4f}")


class AssembleExact(_StudentTask):
    """The student of ``blocks`` assembled without padding (:func:`zgcore.models.hetero.assemble_exact`):
    a plain family folder when every layer has one shape, else a heterogeneous folder with its
    modelling code (``trust_remote_code``). Its hash is its blocks' (the chosen candidates'),
    never a budget's, so budgets choosing the same candidates share it. Writes ``model/`` and
    ``assembled.json`` ``{"non_embedding_params", "heterogeneous"}``."""

    code_version = 2  # 2: a heterogeneous folder's config.json says model_type "llama" (its tokenizer loads without remote code)

    def requires(self):
        return {"teacher": self.teacher_task(), "blocks": self.block_tasks()}

    def own_config(self):
        return {"padding": False}

    def label(self):
        return "student-exact"

    def run(self):
        _rec, (teacher, tok) = self.load_teacher()
        student = assemble_exact(teacher, load_blocks(teacher, self.requires()["blocks"], "block"))
        with self.building() as tmp:
            hetero = save_student(student, tok, tmp / "model")
            write_json(tmp / "assembled.json", {"non_embedding_params": costs.non_embedding_params(student),
                                                "heterogeneous": hetero})
        self.log(f"saved {self.out_dir / 'model'} ({costs.non_embedding_params(student):,} non-embedding parameters)")


class ScoreStudent(_StudentTask):
    """Held-out cross-entropy (nats/token) of one assembled student on the test rows
    (:func:`zgcore.evaluation.metrics.eval_subset`) and on every ``eval.extra`` corpus: ``ce.json``
    ``{"ce", "extra": {name: ce}, "params", "model"}`` and per-sequence scores (``SCORES``)."""

    code_version = 2  # 2: each scored row's document id beside its CE, so the report's comparisons resample documents
    eval = luigi.DictParameter(visibility=HIDDEN)

    def requires(self):
        kw = self.shared_params(boundary=self.boundary, blocks=self.blocks, study=self.study, device=self.device)
        req = {"assemble": AssembleExact(**kw),
               "corpus": self.shared(PrepareCorpus)}
        if held_out_tasks(self, self.eval):
            req["extra"] = held_out_tasks(self, self.eval)
        return req

    def own_config(self):
        return {"eval": {k: self.eval[k] for k in ("max_sequences", "subset_seed", "extra")}}

    def label(self):
        return "student-ce"

    def run(self):
        import torch
        from transformers import AutoModelForCausalLM

        req = self.requires()
        folder = req["assemble"].out_dir / "model"
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=True).to(self.device)
        val_all = corpus.read_tokens(req["corpus"].out_dir / "tokens.h5", "val")
        rows = metrics.eval_subset(len(val_all), int(self.eval["max_sequences"]), int(self.eval["subset_seed"]))
        per_seq = {"student": metrics.sequence_cross_entropy(model, val_all[rows], int(self.eval["batch_size"]),
                                                            desc="CE student (test rows)")}
        extra, extra_scores = heldout_score.score([(json.loads((t.out_dir / "meta.json").read_text()), read_held_out(t))
                                                   for t in req.get("extra", [])], [("student", model)], self.eval)
        ce = float(per_seq["student"].mean())
        if not math.isfinite(ce):
            raise ValueError(f"student {folder}: held-out CE is not finite")
        assembled = json.loads((req["assemble"].out_dir / "assembled.json").read_text())
        with self.building() as tmp:
            write_json(tmp / "ce.json", {"ce": ce, "extra": {e["name"]: e["cross_entropy"]["student"] for e in extra},
                                         "sequences": len(rows), "params": assembled["non_embedding_params"],
                                         "heterogeneous": assembled["heterogeneous"], "model": str(folder)})
            docs = corpus.read_documents(req["corpus"].out_dir / "tokens.h5", "val")
            save_scores(tmp / SCORES, scores_part(per_seq, rows, None if docs is None else docs[rows]), extra_scores)
        self.log(f"held-out CE {ce:.4f} nats/token")
