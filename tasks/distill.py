"""The distillation study: its end-to-end arm ``DistillE2E`` (with ``EvaluateStudent``) and
its report ``DistillStudyReport``; the healing stage ``Heal`` is :mod:`tasks.heal`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import luigi

from zgcore.data import corpus
from zgcore.training import distill as zdistill
from zgcore.atomic import write_json, write_text
from zgcore.evaluation.compare import SCORES, check_same_sequences, load_scores, save_scores, scores_part
from zgcore.config.distill import distill_hashed
from zgcore.training.loop import FINAL_STATE, LOSS_LOG

from . import search
from .assemble import _StudentTask
from .base import HIDDEN
from .cache import TeacherBoundary
from .evaluate import Evaluate
from .heal import Heal, _DistillTask
from .teacher import PrepareCorpus


def student_dir(task) -> Path:
    """The Hugging Face folder of a finished Assemble, Heal or DistillE2E task."""
    return task.out_dir / "model"


def read_metrics(task) -> dict[str, Any]:
    """``metrics.json`` of a finished training task."""
    return json.loads((task.out_dir / "metrics.json").read_text())


class DistillE2E(_DistillTask):
    """The distillation study's end-to-end arm: the blockwise arm's student before training (same
    kept layers, same initialisation), trained whole on the teacher's logits (and, with
    ``distill.hidden_weight`` > 0, its residual stream at every interior boundary) for as many
    student layer-token passes as the blockwise arm (:func:`zgcore.training.distill.e2e_steps`) unless
    ``distill.steps`` is set; with ``heal`` (``steps`` > 0) as many as the blockwise arm plus that
    healing stage, whatever ``distill.steps`` says (so that "healing beats e2e" is
    judged at equal passes). The teacher runs online (no boundary cache is needed), or with
    ``distill.targets = "cached"`` its top-k targets come from the logit store
    (:class:`tasks.logits.TeacherLogitStore`) and only the student's own weights are read of it.

    With ``distill.lrs`` the arm searches its lr (:mod:`zgcore.training.lr_search`): each
    candidate is a DistillE2E at one lr (``candidate=True``), trained at this arm's full budget
    and scored by held-out CE on the validation sequences outside the test subset (EvaluateStudent
    without context use, :func:`tune_eval`),
    yielded round by round as dynamic dependencies; this task's output is then a copy of the
    chosen candidate's plus ``search.json`` (every lr searched, its CE, edge, diverged ones). A
    candidate whose training diverges writes only ``diverged.json`` and loses."""

    # 2: distill.lrs (the search), the heal-matched budget, diverged candidates recorded
    code_version = 2
    distill = luigi.DictParameter(visibility=HIDDEN, description="the experiment's distill section")
    heal = luigi.DictParameter(default={}, visibility=HIDDEN,
                               description="with steps > 0: match the passes of blockwise training plus this healing stage")
    candidate = luigi.BoolParameter(default=False, significant=False,
                                    description="a candidate of an lr search: a divergence is recorded, not raised")
    eval = luigi.DictParameter(default={}, visibility=HIDDEN, significant=False,
                               description="the experiment's eval section: how search candidates are scored (with distill.lrs; hashed then)")
    section = "distill"

    def requires(self):
        req = {"teacher": self.teacher_task(), "corpus": self.corpus_task(), **self.logit_requires()}
        imp = importance_task(self)
        if imp is not None:
            req["importance"] = imp
        return req

    def matches_heal(self) -> bool:
        """Whether the budget covers a healing stage too (``heal.steps`` > 0)."""
        return bool(int(dict(self.heal).get("steps", 0)))

    def own_config(self):
        """Only what decides the result: the distill section, each block's student shape and
        (for matched steps) step count (:func:`zgcore.training.distill.e2e_block_settings`), and where the
        boundaries lie (not how a cache would be stored: no cache is read)."""
        from zgcore.hashing import canonical

        matched = self.matches_heal() or not int(self.distill["steps"])  # the step count follows the blocks'
        d = distill_hashed(self.distill)
        if self.matches_heal():  # the budget is blockwise + healing, whatever distill.steps says
            d.pop("steps", None)
        b = canonical(self.boundary)
        out = {"distill": d, "blocks": [zdistill.e2e_block_settings(canonical(t), matched) for t in self.blocks],
               "boundary": {"boundaries": b["boundaries"]} if b["boundaries"] is not None else {"num_blocks": b["num_blocks"]}}
        if self.matches_heal():
            out["match_heal"] = {"steps": int(self.heal["steps"]), "batch_size": int(self.heal["batch_size"])}
        if self.distill.get("lrs"):  # how the candidates are scored decides the choice
            out["tune_eval"] = tune_eval(self.eval)
        return out

    def label(self):
        lr = "-lrs" if self.distill.get("lrs") else f"-lr{float(self.distill['lr']):g}" if self.candidate else ""
        k = int(self.distill.get("top_k") or 0)
        return (f"e2e-T{self.distill['temperature']}-h{self.distill['hidden_weight']}{lr}"
                + (f"-top{k}-{self.distill['targets']}" if k else "")
                + (f"-heal{int(self.heal['steps'])}" if self.matches_heal() else ""))

    def settings(self):
        return {**dict(self.distill), "steps": self._steps}

    # -- the lr search
    def candidate_task(self, lr: float) -> DistillE2E:
        """This arm at one peak lr, without a search."""
        d = {**dict(self.distill), "lr": float(lr), "lrs": []}
        return self.shared(DistillE2E, boundary=self.boundary, blocks=self.blocks, distill=d, heal=self.heal,
                           candidate=True, study=self.study, device=self.device)

    def score_task(self, candidate: DistillE2E) -> EvaluateStudent:
        if not self.eval:
            raise ValueError("DistillE2E with distill.lrs needs the experiment's eval section (eval=...) to score candidates")
        return self.shared(EvaluateStudent, boundary=self.boundary, blocks=self.blocks, distill=candidate.distill,
                           heal=self.heal, candidate=True, eval=tune_eval(self.eval), device=self.device)

    def score_of(self, task) -> dict:
        e = json.loads((task.out_dir / "eval.json").read_text())
        return {"score": e["ce"], "diverged": e.get("diverged")}

    def check_tune_rows(self) -> None:
        n_val = int(corpus.read_meta(self.corpus_task().out_dir / "tokens.h5")["n_val"])
        search.tune_rows(n_val, self.eval, "distill.lrs")

    def keep_chosen(self, best, tmp, s, record) -> None:
        search.copy_output(best.out_dir, tmp, ("model", "metrics.json", LOSS_LOG, FINAL_STATE))
        write_json(tmp / "search.json", record)

    def run(self):
        yield from search.LRSearch(self, "distill").run(lambda: _DistillTask.run(self))

    def dynamic_upstream(self) -> list:
        return search.LRSearch(self, "distill").dynamic_upstream()

    def start_student(self, teacher):
        """The blockwise arm's untrained student (:func:`zgcore.training.distill.initial_student`): built
        from the loaded teacher online; with cached targets (``teacher`` None) from the kept layers'
        weights alone and the teacher's embedding, final norm and LM head
        (:func:`zgcore.models.teacher_weights.layer_source`, :func:`~zgcore.models.teacher_weights.load_head`)."""
        from zgcore.models.shapes import resolve_boundaries
        from zgcore.models.teacher_weights import layer_source, load_head

        from .teacher import teacher_record

        n_train = int(corpus.read_meta(self.corpus_task().out_dir / "tokens.h5")["n_train"])
        head = None
        if teacher is None or hasattr(teacher, "precompute"):  # cached targets or a streamed teacher: never the whole
            rec = teacher_record(self.teacher_task())
            teacher, head = layer_source(rec, self.device), load_head(rec, self.device)
        bounds = resolve_boundaries(self.boundary, int(teacher.config.get_text_config().num_hidden_layers))
        imp = self.requires().get("importance")
        measured = json.loads((imp.out_dir / "importance.json").read_text()) if imp is not None else None
        student, pairs, passes = zdistill.initial_student(teacher, bounds, self.blocks, n_train, measured, head=head)
        layers = sum(n for _, _, n in passes)
        bs = int(self.distill["batch_size"])
        matched = zdistill.e2e_steps(passes, layers, bs)
        if self.matches_heal():  # blockwise + healing: the healing stage trains all `layers` layers
            heal_pass = (int(self.heal["steps"]), int(self.heal["batch_size"]), layers)
            self._steps = zdistill.e2e_steps(list(passes) + [heal_pass], layers, bs)
            what = f"blockwise + healing ({heal_pass[0]} steps of {heal_pass[1]})"
        else:
            self._steps = int(self.distill["steps"]) or matched
            what = "blockwise"
        self.log(f"{self._steps} end-to-end steps of {bs} sequences through {layers} layers "
                 f"(matched to the {what} arm's passes; blockwise alone: {matched})")
        return student.train(), pairs, {"matched_steps": matched, "student_layers": layers, "block_passes": passes,
                                        "pairs": pairs, "lr": float(self.distill["lr"]),
                                        "budget": "blockwise+heal" if self.matches_heal() else "blockwise"}


def arm_lr(task, configured: float) -> dict:
    """The lr a finished training task (TrainBlock, DistillE2E) trained at: ``{"lr"}`` as
    configured, or, where it searched (``search.json``), ``{"lr", "search"}`` with the search's
    record (every lr searched, its score, ``at_edge``, ``converged``, ``diverged``)."""
    path = task.out_dir / "search.json"
    if not path.exists():
        return {"lr": float(configured)}
    s = json.loads(path.read_text())
    return {"lr": s["best_lr"], "search": s}


def tune_eval(ev) -> dict:
    """How an lr search's candidates are scored: the experiment's eval settings without context use,
    on the validation sequences outside the test subset (``tune``; :func:`zgcore.evaluation.metrics.tune_subset`)."""
    return {**dict(ev), "context_sequences": 0, "tune": True}


def importance_task(task):
    """The teacher's layer and channel measurements the blocks' students are chosen by (the same
    ``LayerImportance`` task the TrainBlocks read), or ``None`` when no block uses them."""
    from zgcore.models import students

    from .students import layer_importance

    need = [t for t in task.blocks if students.needs_measure(t)]
    return layer_importance(task, need[0]) if need else None


class EvaluateStudent(_StudentTask):
    """Held-out CE (nats/token) and context use of one trained student folder (the end-to-end arm),
    on the same seeded subset of the validation split as :class:`~tasks.evaluate.Evaluate` and (not
    for a search candidate) on every ``eval.extra`` corpus; writes ``eval.json`` (``{"ce": null,
    "diverged": {...}}`` for a diverged search candidate) and ``per_sequence_ce.json`` (key ``student``).
    A search candidate (``eval.tune``, :func:`tune_eval`) is scored on the validation sequences
    outside that test subset instead (:func:`zgcore.evaluation.metrics.tune_subset`): no lr is chosen on the
    sequences the arms' CE is reported on."""

    # 2: random test subset (eval.max_sequences, eval.subset_seed), per-sequence CE, eval.extra corpora
    # 3: a search candidate is scored outside the test subset
    # 4: each scored row's document id in per_sequence_ce.json
    code_version = 4
    eval = luigi.DictParameter(visibility=HIDDEN)
    distill = luigi.DictParameter(visibility=HIDDEN)
    heal = luigi.DictParameter(default={}, visibility=HIDDEN, description="DistillE2E's heal (budget matching)")
    candidate = luigi.BoolParameter(default=False, significant=False, description="DistillE2E's candidate flag")

    def requires(self):
        from .heldout import held_out_tasks

        req = {"model": self.shared(DistillE2E, boundary=self.boundary, blocks=self.blocks, distill=self.distill,
                                    heal=self.heal, candidate=self.candidate, eval=self.eval, study=self.study,
                                    device=self.device),
               "corpus": self.shared(PrepareCorpus)}
        if not self.candidate and held_out_tasks(self, self.eval):  # a search candidate is scored in-domain only
            req["extra"] = held_out_tasks(self, self.eval)
        return req

    def own_config(self):
        return {"eval": self.eval}

    def label(self):
        return self.requires()["model"].label() + "-eval"

    def run(self):
        import torch
        from transformers import AutoModelForCausalLM

        from zgcore.evaluation import compare, heldout_score, metrics

        from .heldout import read_held_out

        req = self.requires()
        div = search.diverged(req["model"])
        if div is not None:  # only a search candidate records a divergence: it has no CE and loses
            with self.building() as tmp:
                write_json(tmp / "eval.json", {"ce": None, "diverged": div, "context_use": None})
            self.log(f"lr {div['lr']:g} diverged ({div['what']} at step {div['step']}): no CE")
            return
        val_all = corpus.read_tokens(req["corpus"].out_dir / "tokens.h5", "val")
        pick = metrics.tune_subset if self.eval.get("tune") else metrics.eval_subset
        rows = pick(len(val_all), int(self.eval["max_sequences"]), int(self.eval["subset_seed"]))
        val = val_all[rows]
        docs = corpus.read_documents(req["corpus"].out_dir / "tokens.h5", "val")
        docs = None if docs is None else docs[rows]
        model = AutoModelForCausalLM.from_pretrained(student_dir(req["model"]), dtype=torch.float32).to(self.device)
        per_seq = metrics.sequence_cross_entropy(model, val, int(self.eval["batch_size"]), desc="CE e2e")
        ce = float(per_seq.mean())
        n_ctx = min(int(self.eval["context_sequences"]), len(val))
        cu = metrics.context_use(model, val[:n_ctx], int(self.eval["context_window"])) if n_ctx else None
        extra, extra_scores = heldout_score.score([(json.loads((t.out_dir / "meta.json").read_text()), read_held_out(t))
                                             for t in req.get("extra", [])], [("student", model)], self.eval)
        with self.building() as tmp:
            write_json(tmp / "eval.json", {"ce": ce, "context_use": cu, "val_tokens": int(val.size),
                                           "subset_sha256": compare.subset_digest(rows), "extra": extra})
            compare.save_scores(tmp / compare.SCORES, compare.scores_part({"student": per_seq}, rows, docs), extra_scores)
        self.log(f"held-out CE {ce:.4f} nats/token")


def arm_scores(req: dict) -> tuple[dict[str, Any], Any]:
    """Each arm's per-sequence held-out CE (float64 ``[n]``, nats/token) from the evaluations in a
    DistillStudyReport's ``req`` (Evaluate tasks: their ``student``; EvaluateStudent: its only
    model), and the held-out rows they scored (checked to be the same for every arm)."""
    parts = {k: load_scores(t.out_dir / SCORES)["val"] for k, t in req.items()
             if k in ("blockwise", "healed") or isinstance(t, EvaluateStudent)}
    check_same_sequences([p["subset_sha256"] for p in parts.values()], "distillation study's arms")
    first = next(iter(parts.values()))
    return {k: p["ce"]["student"] for k, p in parts.items()}, first["rows"], first.get("documents")


class DistillStudyReport(_StudentTask):
    """Blockwise vs end-to-end vs blockwise + healing vs end-to-end at the blockwise + healing
    budget, side by side (``report.json``, ``report.md``): each arm's held-out CE beside the
    student layer-token passes it spent, and the lr it trained at (and, where searched, what was
    searched and whether the choice sits at an edge). Arms (a) and (c) are the experiment's own
    Evaluate tasks (without and with ``heal``), so a finished experiment's blocks are reused."""

    # 2: the report takes its gap and gates from zgcore.evaluation.report (commit 3d0ea91)
    # 3: arm (d) end to end at the blockwise + healing budget; each arm's lr and lr search
    # 4: comparisons (paired bootstrap over held-out sequences), the arms' per_sequence_ce.json, eval.extra per arm
    # 5: the seed-sign rule: a verdict with several seeds needs every seed's difference on its side ("why")
    # 6: method comparisons over training runs (fewer than 3: not resolved), Holm-adjusted; documents resampled;
    #    FLOPs per arm; a plumbing check (smoke preset, random teacher) gives no verdict
    # 7: the crossed run-level estimate, the document minimum, Holm-level intervals; vs-untrained with documents
    code_version = 7
    uses_device = False  # reads the arms' results only
    eval = luigi.DictParameter(visibility=HIDDEN)
    heal = luigi.DictParameter(visibility=HIDDEN)
    distill = luigi.DictParameter(visibility=HIDDEN)
    name = luigi.Parameter(default="distill-study", significant=False)

    def requires(self):
        """The four arms' evaluations and every output the report reads besides them: the
        end-to-end models' and the healing stage's metrics, the blocks' (lr searches), and
        (cached targets) the cache's manifest."""
        kw = self.shared_params(boundary=self.boundary, blocks=self.blocks, study=self.study_name(), device=self.device)
        req = {"blockwise": Evaluate(eval=self.eval, name=self.name, **kw),
               "e2e": EvaluateStudent(eval=self.eval, distill=self.distill, **kw),
               "healed": Evaluate(eval=self.eval, heal=self.heal, name=self.name, **kw),
               "e2e_healed": EvaluateStudent(eval=self.eval, distill=self.distill, heal=self.heal, **kw),
               "e2e_model": DistillE2E(distill=self.distill, eval=self.eval, **kw),
               "e2e_healed_model": DistillE2E(distill=self.distill, heal=self.heal, eval=self.eval, **kw),
               "heal": Heal(heal=self.heal, **kw), "blocks": self.block_tasks()}
        if any(t["targets"] == "cached" for t in self.blocks):
            req["cache"] = self.shared(TeacherBoundary, boundary=self.boundary, device=self.device)
        return req

    def own_config(self):
        return {}

    def label(self):
        return "distill-study"

    def run(self):
        from zgcore.evaluation import distill_report, distill_study

        req = self.requires()
        scores, rows, docs = arm_scores(req)
        rep = distill_study.study_report(distill_study.StudyInputs(
            name=self.name, teacher=self.teacher, eval=self.eval, heal=self.heal, distill=self.distill,
            train=self.blocks, blockwise=json.loads((req["blockwise"].out_dir / "report.json").read_text()),
            healed=json.loads((req["healed"].out_dir / "report.json").read_text()),
            heal_metrics=read_metrics(req["heal"]),
            e2e={k: (json.loads((req[k].out_dir / "eval.json").read_text()), read_metrics(req[f"{k}_model"]),
                     arm_lr(req[f"{k}_model"], float(self.distill["lr"]))) for k in distill_study.E2E_ARMS},
            block_lrs=[arm_lr(t, float(t.train.get("lr", 0))) for t in req["blocks"]], scores=scores, rows=rows,
            docs=docs,
            untrained=load_scores(req["blockwise"].out_dir / SCORES)["val"]["ce"]["untrained"],
            cache=json.loads((req["cache"].out_dir / "manifest.json").read_text()) if "cache" in req else None))
        rep["reports"] = {"blockwise": str(req["blockwise"].out_dir), "healed": str(req["healed"].out_dir)}
        with self.building() as tmp:
            write_json(tmp / "report.json", rep)
            save_scores(tmp / SCORES, scores_part(scores, rows, docs))
            write_text(tmp / "report.md", distill_report.markdown(rep))
