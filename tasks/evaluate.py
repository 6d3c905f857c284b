"""The last stage of the experiment graph: Evaluate, the held-out report of one student (assembled,
or healed when ``heal.steps`` > 0) against the teacher and the untrained student."""
from __future__ import annotations

import json

import luigi

from zgcore.data import corpus
from zgcore.evaluation import heldout_score, metrics, plots, report as zreport
from zgcore.models.hetero import assemble_student
from zgcore.atomic import write_json, write_text
from zgcore.evaluation.flops import model_parameters
from zgcore.evaluation.compare import SCORES, save_scores, scores_part, subset_digest

from .assemble import Assemble, _StudentTask
from .base import HIDDEN
from .blocks import load_blocks
from .cache import TeacherBoundary
from .heal import Heal
from .heldout import held_out_tasks, read_held_out
from .teacher import PrepareCorpus


class Evaluate(_StudentTask):
    """Held-out cross-entropy of the teacher, the untrained student and the assembled student, on
    the validation split (a seeded random subset of ``eval.max_sequences`` rows when set) and on
    every ``eval.extra`` corpus; writes ``report.json``, ``report.md`` (assembled by
    :mod:`zgcore.evaluation.report`) and ``per_sequence_ce.json`` (:func:`zgcore.evaluation.compare.save_scores`)."""

    # 2: random test subset (eval.max_sequences, eval.subset_seed), per-sequence CE, eval.extra corpora, comparisons
    # 3: the seed-sign rule: a verdict with several seeds needs every seed's difference on its side ("why")
    # 4: fixed-model comparisons labelled "unit": "sequence", resampling documents; each scored row's document id;
    #    parameters per decoder layer and LM head of the teacher and the student (for FLOPs)
    code_version = 4
    eval = luigi.DictParameter(visibility=HIDDEN)
    name = luigi.Parameter(default="experiment", significant=False)
    heal = luigi.DictParameter(default={"steps": 0}, visibility=HIDDEN,
                               description="heal section; steps > 0 evaluates the healed student (tasks.heal.Heal)")

    def requires(self):
        kw = dict(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary, blocks=self.blocks,
                  study=self.study_name(), outputs=self.outputs, device=self.device)
        if int(self.heal.get("steps", 0)):
            student = Heal(heal=self.heal, **kw)  # the healed student takes the assembled one's place
        else:
            student = Assemble(**kw)
        req = {"teacher": self.teacher_task(), "assemble": student,
               "corpus": PrepareCorpus(teacher=self.teacher, corpus=self.corpus, outputs=self.outputs),
               "blocks": self.block_tasks()}  # metrics.json, init/block weights and loss logs are read here
        if any(t["targets"] == "cached" for t in self.blocks):  # its manifest feeds the cache economics
            req["cache"] = TeacherBoundary(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary,
                                           outputs=self.outputs, device=self.device)
        if int(self.heal.get("steps", 0)) and self.heal.get("targets") == "cached":  # its manifest: the store's cost
            from .logits import logit_store_task

            req["logits"] = logit_store_task(self, self.heal)
        if held_out_tasks(self, self.eval):  # eval.extra: out-of-domain held-out corpora
            req["extra"] = held_out_tasks(self, self.eval)
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
        val_all = corpus.read_tokens(req["corpus"].out_dir / "tokens.h5", "val")
        rows = metrics.eval_subset(len(val_all), int(self.eval["max_sequences"]), int(self.eval["subset_seed"]))
        val = val_all[rows]
        docs = corpus.read_documents(req["corpus"].out_dir / "tokens.h5", "val")
        docs = None if docs is None else docs[rows]
        model_dir = req["assemble"].out_dir / "model"
        # trust_remote_code: a converted student's folder carries its modelling code (zgcore.models.hf_converted_llama)
        student = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, trust_remote_code=True).to(self.device)
        untrained = assemble_student(teacher, load_blocks(teacher, req["blocks"], "init"))
        models = (("teacher", teacher), ("untrained", untrained), ("student", student))
        ce, cu, per_seq = metrics.held_out(models, val, self.eval, self.progress)
        extra, extra_scores = heldout_score.score([(json.loads((t.out_dir / "meta.json").read_text()), read_held_out(t))
                                             for t in req.get("extra", [])], models, self.eval)
        ids = tok("The", return_tensors="pt").input_ids.to(self.device)
        sample = tok.decode(student.generate(ids, max_new_tokens=24, do_sample=False)[0], skip_special_tokens=True)
        blocks = [json.loads((t.out_dir / "metrics.json").read_text()) for t in req["blocks"]]
        bounds = [b["start"] for b in blocks] + [blocks[-1]["end"]]
        n_shift = min(int(self.eval["context_sequences"]) or 4, len(val))
        report = zreport.experiment_report(
            {"name": self.name, "teacher": self.teacher, "boundaries": bounds, "seq_len": int(val.shape[1]),
             "val_sequences": int(len(val)), "val_tokens": int(val.size), "cross_entropy": ce,
             "subset": {"sequences": int(len(rows)), "of": int(len(val_all)), "seed": int(self.eval["subset_seed"]),
                        "sha256": subset_digest(rows)}, "extra": extra,
             "layers": {k: m.config.get_text_config().num_hidden_layers for k, m in models},
             "parameters": {k: model_parameters(m) for k, m in models if k != "untrained"},
             "blocks": blocks, "model_dir": str(model_dir), "sample": sample, "context_use": cu,
             "heal_steps": int(self.heal.get("steps", 0)),
             "comparisons": zreport.model_comparisons(per_seq, int(self.blocks[0]["seed"]), extra_scores, docs),
             "context_window": int(self.eval["context_window"]), "context_sequences": min(int(self.eval["context_sequences"]), len(val)),
             "shift": metrics.boundary_shift(teacher, load_blocks(teacher, req["blocks"], "block"), bounds, val[:n_shift])},
            self.eval)
        if "cache" in req:
            manifest = json.loads((req["cache"].out_dir / "manifest.json").read_text())
            report["economics"] = zreport.economics(manifest, blocks, [t["batch_size"] for t in self.blocks],
                                                    lambda s, e, b: metrics.teacher_forward_seconds(teacher, val, s, e, b))
        if "logits" in req:
            report["logit_store"] = zreport.logit_store_cost(json.loads((req["logits"].out_dir / "manifest.json").read_text()))
        with self.building() as tmp:
            write_json(tmp / "report.json", report)
            write_text(tmp / "report.md", zreport.report_markdown(report))
            save_scores(tmp / SCORES, scores_part(per_seq, rows, docs), extra_scores)
            plots.loss_curves([(f"block {t.block}", t.out_dir / "loss_log.csv") for t in req["blocks"]], tmp / "loss_curves.png")
            plots.drift(report["shift"], tmp / "drift.png")
        print(f"\nReport: {self.out_dir / 'report.md'}\n{zreport.summary_line(report)}", flush=True)
