"""The last stage of the experiment graph: Evaluate, the held-out report of one student (assembled,
or healed when ``heal.steps`` > 0) against the teacher and the untrained student. It is a join: it
reads the scoring tasks' outputs (:mod:`tasks.score`, :mod:`tasks.score_student`) and runs no model,
so a one-block change scores the new student only."""
from __future__ import annotations

import json

import luigi

from zgcore.data import corpus
from zgcore.evaluation import flops, joined, plots, report as zreport, utilisation

from .assemble import _StudentTask
from .base import HIDDEN
from .cache import TeacherBoundary
from .heldout import held_out_tasks
from .score import METRICS, SCORES as SCORE_FILE, ScoreTeacher, ScoreUntrained
from .score_student import SHIFT, BoundaryShift, ScoreAssembled, student_model_task
from .teacher import PrepareCorpus


def score_tasks(task, held_out: dict | None = None) -> dict:
    """The teacher's, the untrained student's and the student's scoring tasks of an evaluation task
    (``Evaluate``) on the validation split's test rows (``held_out`` None) or one ``eval.extra`` corpus."""
    kw = task.shared_params(eval=task.eval, held_out=held_out or {}, device=task.device)
    return {"teacher": ScoreTeacher(**kw),
            "untrained": ScoreUntrained(boundary=task.boundary, blocks=task.blocks, **kw),
            "student": ScoreAssembled(boundary=task.boundary, blocks=task.blocks, heal=task.heal, study=task.study_name(),
                                      **kw)}


def read_scores(tasks: dict) -> dict:
    """``{key: scores.json}`` of finished scoring tasks."""
    return {k: json.loads(t.checked(SCORE_FILE).read_text()) for k, t in tasks.items()}


class Evaluate(_StudentTask):
    """Held-out cross-entropy of the teacher, the untrained student and the assembled student, on
    the validation split (a seeded random subset of ``eval.max_sequences`` rows when set) and on
    every ``eval.extra`` corpus, joined from their scoring tasks; writes ``report.json``,
    ``report.md`` (assembled by :mod:`zgcore.evaluation.report`, with the compute utilisation table
    of :mod:`zgcore.evaluation.utilisation`) and ``per_sequence_ce.json`` (:func:`zgcore.evaluation.compare.save_scores`)."""

    # 2: random test subset (eval.max_sequences, eval.subset_seed), per-sequence CE, eval.extra corpora, comparisons
    # 3: the seed-sign rule: a verdict with several seeds needs every seed's difference on its side ("why")
    # 4: fixed-model comparisons labelled "unit": "sequence", resampling documents; each scored row's document id;
    #    parameters per decoder layer and LM head of the teacher and the student (for FLOPs)
    # 5: the document minimum for a verdict, eval.extra comparisons with documents, a random teacher's comparisons
    #    descriptive, the quality gate undefined where the gap is
    #    and a join of the scoring tasks (same figures); the teacher's time per batch for the cache economics from the
    #    cache build's measurement; the compute utilisation table ("mfu")
    code_version = 5
    uses_device = False  # reads scores only
    eval = luigi.DictParameter(visibility=HIDDEN)
    name = luigi.Parameter(default="experiment", significant=False)
    heal = luigi.DictParameter(default={"steps": 0}, visibility=HIDDEN,
                               description="heal section; steps > 0 evaluates the healed student (tasks.heal.Heal)")

    def requires(self):
        req = {"scores": score_tasks(self), "assemble": student_model_task(self, self.heal),
               "shift": self.shared(BoundaryShift, boundary=self.boundary, blocks=self.blocks, eval=self.eval,
                                    study=self.study_name(), device=self.device),
               "corpus": self.shared(PrepareCorpus),
               "blocks": self.block_tasks()}  # metrics.json and loss logs are read here
        if any(t["targets"] == "cached" for t in self.blocks):  # its manifest feeds the cache economics
            req["cache"] = self.shared(TeacherBoundary, boundary=self.boundary, device=self.device)
        if int(self.heal.get("steps", 0)) and self.heal.get("targets") == "cached":  # its manifest: the store's cost
            from .logits import logit_store_task

            req["logits"] = logit_store_task(self, self.heal)
        extra = held_out_tasks(self, self.eval)
        if extra:  # eval.extra: out-of-domain held-out corpora, each scored for every model
            req["extra"] = [score_tasks(self, dict(t.extra)) for t in extra]
        return req

    def own_config(self):
        return {"eval": self.eval}

    def label(self):
        return "report"

    def run(self):
        req = self.requires()
        manifest = json.loads((req["cache"].out_dir / "manifest.json").read_text()) if "cache" in req else None
        ev = joined.evaluate(joined.EvaluationInputs(
            name=self.name, teacher=self.teacher, eval=self.eval, train=self.blocks,
            val=corpus.read_tokens(req["corpus"].out_dir / "tokens.h5", "val"), scores=read_scores(req["scores"]),
            extra=[read_scores(tasks) for tasks in req.get("extra", [])],
            blocks=[json.loads((t.out_dir / "metrics.json").read_text()) for t in req["blocks"]],
            shift=json.loads(req["shift"].checked(SHIFT).read_text()), heal_steps=int(self.heal.get("steps", 0)),
            cache=manifest,
            logits=json.loads((req["logits"].out_dir / "manifest.json").read_text()) if "logits" in req else None))
        rep = ev.report
        rep["mfu"] = self.phases(req, rep["blocks"], ev.parameters, manifest, rep["seq_len"], rep["boundaries"][-1])
        with self.building() as tmp:
            ev.save(tmp)
            plots.loss_curves([(f"block {t.block}", t.out_dir / "loss_log.csv") for t in req["blocks"]], tmp / "loss_curves.png")
            plots.drift(rep["shift"], tmp / "drift.png")
        self.log(zreport.summary_line(rep))  # the run's `Report: <path>` line comes last (workflows/ending.py)

    def phases(self, req, blocks, parameters, manifest, seq_len, last) -> list[dict]:
        """The compute utilisation rows (:mod:`zgcore.evaluation.utilisation`): cache build, each
        block, healing, then every scoring task, each from its own ``metrics.json``."""
        from zgcore.training.mfu import probe

        here = lambda: probe(self.device)  # noqa: E731 (measured only for outputs that recorded no peak)
        rows = []
        if manifest:
            rows.append(_cache_phase(req["cache"], manifest, parameters["teacher"], seq_len, last, here))
        at, width = 0, parameters["student"]["width"]
        for b, t in zip(blocks, self.blocks):
            n = len(b["kept"])
            work = flops.block_train_flops(parameters["student"]["layers"][at: at + n], width, seq_len, b["steps"],
                                           int(t["batch_size"]))
            at += n
            rows.append(utilisation.from_metrics(f"block {b['block']}", b, here, work))
        if int(self.heal.get("steps", 0)):
            m = json.loads((req["assemble"].out_dir / "metrics.json").read_text())
            teacher = None if self.heal.get("targets") == "cached" else parameters["teacher"]
            work = flops.heal_flops(seq_len, teacher, parameters["student"], m["steps"], int(self.heal["batch_size"]),
                                    store_sequences=None if teacher is not None else 0)["total"]
            rows.append(utilisation.from_metrics("healing", m, here, work))
        scoring = [req["scores"]] + req.get("extra", [])
        for tasks in scoring:
            for t in tasks.values():
                rows.append(utilisation.from_metrics(f"scoring {t.label()}", json.loads(t.checked(METRICS).read_text()), here))
        rows.append(utilisation.from_metrics("scoring boundary shift", json.loads(req["shift"].checked(METRICS).read_text()), here))
        return rows


def _cache_phase(cache, manifest, teacher, seq_len: int, last: int, here) -> dict:
    """The cache build's row: its shards' seconds and FLOPs summed, against the first shard's own
    peak (every shard of one build runs on one kind of device); the report's peak and counted FLOPs
    for a cache built before shards recorded them."""
    from .cache import SHARD_METRICS

    recs = [t.out_dir / SHARD_METRICS for t in cache.shard_tasks() or []]
    if recs and all(p.is_file() for p in recs):
        ms = [json.loads(p.read_text()) for p in recs]
        return utilisation.phase("cache build", sum(m["seconds"] for m in ms), sum(m["flops"] for m in ms), ms[0]["peak"])
    work = flops.cache_build_flops(teacher, int(manifest["n_train"]) + int(manifest["n_val"]), seq_len, last)
    return utilisation.phase("cache build", float(manifest["build_seconds"]), work, here(), "report")
