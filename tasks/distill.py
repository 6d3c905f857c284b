"""The distillation study (issue 14): its end-to-end arm ``DistillE2E`` (with ``EvaluateStudent``) and
its report ``DistillStudyReport``; the healing stage ``Heal`` is :mod:`tasks.heal`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import luigi

from zgcore import corpus, distill as zdistill
from zgcore.atomic import write_json, write_text

from .assemble import _StudentTask
from .base import HIDDEN
from .cache import TeacherBoundary
from .evaluate import Evaluate
from .heal import Heal, _DistillTask, heal_hashed
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
    student layer-token passes as the blockwise arm (:func:`zgcore.distill.e2e_steps`) unless
    ``distill.steps`` is set. The teacher runs online; no boundary cache is needed."""

    distill = luigi.DictParameter(visibility=HIDDEN, description="the experiment's distill section")
    section = "distill"
    code_deps = _DistillTask.code_deps + ("zgcore.config:kept_layers", "zgcore.students", "zgcore.train:block_seed")

    def requires(self):
        req = {"teacher": self.teacher_task(), "corpus": self.corpus_task()}
        imp = importance_task(self)
        if imp is not None:
            req["importance"] = imp
        return req

    def own_config(self):
        from zgcore.train import effective_train
        from zgcore.hashing import canonical

        return {"distill": heal_hashed(self.distill), "blocks": [effective_train(canonical(t)) for t in self.blocks],
                "boundary": canonical(self.boundary)}

    def label(self):
        return f"e2e-T{self.distill['temperature']}-h{self.distill['hidden_weight']}"

    def settings(self):
        return {**dict(self.distill), "steps": self._steps}

    def start_student(self, teacher):
        from zgcore.config import resolve_boundaries

        n_train = int(corpus.read_meta(self.corpus_task().out_dir / "tokens.h5")["n_train"])
        bounds = resolve_boundaries(self.boundary, len(zdistill_layers(teacher)))
        imp = self.requires().get("importance")
        measured = json.loads((imp.out_dir / "importance.json").read_text()) if imp is not None else None
        student, pairs, passes = zdistill.initial_student(teacher, bounds, self.blocks, n_train, measured)
        layers = sum(n for _, _, n in passes)
        matched = zdistill.e2e_steps(passes, layers, int(self.distill["batch_size"]))
        self._steps = int(self.distill["steps"]) or matched
        self.log(f"{self._steps} end-to-end steps of {self.distill['batch_size']} sequences through {layers} layers "
                 f"(matched to the blockwise arm's {sum(s * b * n for s, b, n in passes)} layer-sequence passes: {matched})")
        return student.train(), pairs, {"matched_steps": matched, "student_layers": layers, "block_passes": passes,
                                        "pairs": pairs}


def importance_task(task):
    """The teacher's layer and channel measurements the blocks' students are chosen by (the same
    ``LayerImportance`` task the TrainBlocks read), or ``None`` when no block uses them."""
    from zgcore import students

    from .students import layer_importance

    need = [t for t in task.blocks if students.needs_measure(t)]
    return layer_importance(task, need[0]) if need else None


def zdistill_layers(model):
    """The decoder layers of a causal LM."""
    from zgcore.adapters import adapter_for

    return adapter_for(model).decoder_layers(model)


class EvaluateStudent(_StudentTask):
    """Held-out CE (nats/token) and context use of one trained student folder (the end-to-end arm);
    writes ``eval.json``."""

    eval = luigi.DictParameter(visibility=HIDDEN)
    distill = luigi.DictParameter(visibility=HIDDEN)
    code_deps = ("zgcore.metrics:cross_entropy", "zgcore.metrics:context_use")

    def requires(self):
        return {"model": DistillE2E(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary, blocks=self.blocks,
                                    distill=self.distill, outputs=self.outputs, device=self.device),
                "corpus": PrepareCorpus(teacher=self.teacher, corpus=self.corpus, outputs=self.outputs)}

    def own_config(self):
        return {"eval": self.eval}

    def label(self):
        return "e2e-eval"

    def run(self):
        import torch
        from transformers import AutoModelForCausalLM

        from zgcore import metrics

        val = corpus.read_tokens(self.requires()["corpus"].out_dir / "tokens.h5", "val")
        if int(self.eval["max_sequences"]):
            val = val[: int(self.eval["max_sequences"])]
        model = AutoModelForCausalLM.from_pretrained(student_dir(self.requires()["model"]), dtype=torch.float32).to(self.device)
        ce = metrics.cross_entropy(model, val, int(self.eval["batch_size"]), desc="CE e2e")
        n_ctx = min(int(self.eval["context_sequences"]), len(val))
        cu = metrics.context_use(model, val[:n_ctx], int(self.eval["context_window"])) if n_ctx else None
        with self.building() as tmp:
            write_json(tmp / "eval.json", {"ce": ce, "context_use": cu, "val_tokens": int(val.size)})
        self.log(f"held-out CE {ce:.4f} nats/token")


class DistillStudyReport(_StudentTask):
    """Blockwise vs end-to-end vs blockwise + healing, side by side (``report.json``, ``report.md``).
    Arms (a) and (c) are the experiment's own Evaluate tasks (without and with ``heal``), so a
    finished experiment's blocks are reused."""

    # 2: the report takes its gap and gates from zgcore.report (commit 3d0ea91)
    code_version = 2
    uses_device = False  # reads the arms' results only
    eval = luigi.DictParameter(visibility=HIDDEN)
    heal = luigi.DictParameter(visibility=HIDDEN)
    distill = luigi.DictParameter(visibility=HIDDEN)
    name = luigi.Parameter(default="distill-study", significant=False)
    code_deps = ("zgcore.distill_report", "zgcore.report", "zgcore.markdown")

    def requires(self):
        """The three arms' evaluations and every output the report reads besides them: the
        end-to-end model's and the healing stage's metrics, and (cached targets) the cache's manifest."""
        kw = dict(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary, blocks=self.blocks,
                  outputs=self.outputs, device=self.device)
        req = {"blockwise": Evaluate(eval=self.eval, name=self.name, **kw),
               "e2e": EvaluateStudent(eval=self.eval, distill=self.distill, **kw),
               "healed": Evaluate(eval=self.eval, heal=self.heal, name=self.name, **kw),
               "e2e_model": DistillE2E(distill=self.distill, **kw),
               "heal": Heal(heal=self.heal, **kw)}
        if any(t["targets"] == "cached" for t in self.blocks):
            req["cache"] = TeacherBoundary(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary,
                                           outputs=self.outputs, device=self.device)
        return req

    def own_config(self):
        return {}

    def label(self):
        return "distill-study"

    def run(self):
        from zgcore import distill_report

        req = self.requires()
        a = json.loads((req["blockwise"].out_dir / "report.json").read_text())
        c = json.loads((req["healed"].out_dir / "report.json").read_text())
        b = json.loads((req["e2e"].out_dir / "eval.json").read_text())
        e2e = read_metrics(req["e2e_model"])
        heal = read_metrics(req["heal"])
        blocks = [{"task": f"TrainBlock {m['block']}", "seconds": m["seconds"], "peak_rss_mib": m.get("peak_rss_mib")}
                  for m in a["blocks"]]
        stages = []
        if "cache" in req:
            cache = json.loads((req["cache"].out_dir / "manifest.json").read_text())
            stages.append([{"task": "TeacherBoundary", "seconds": cache["build_seconds"],
                            "peak_rss_mib": cache.get("peak_rss_mib")}])
        stages.append(blocks)
        seq = int(a["seq_len"])
        block_passes = sum(m["steps"] * int(t["batch_size"]) * len(m["kept"]) for m, t in zip(a["blocks"], self.blocks)) * seq
        L = e2e["student_layers"]
        heal_stage = [{"task": "Heal", "seconds": heal["seconds"], "peak_rss_mib": heal["peak_rss_mib"]}]
        ce_u, ce_t = a["cross_entropy"]["untrained"], a["cross_entropy"]["teacher"]
        g = (float(self.eval["gate_gap"]), float(self.eval["gate_context"]))
        t_cu = (a.get("context_use") or {}).get("teacher")
        arms = [
            distill_report.arm("blockwise", a["cross_entropy"]["student"], ce_u, ce_t, a.get("context_use"), *g, stages, block_passes),
            distill_report.arm("e2e", b["ce"], ce_u, ce_t, {"teacher": t_cu, "student": b["context_use"]} if t_cu and b["context_use"] else None,
                               *g, [[{"task": "DistillE2E", "seconds": e2e["seconds"], "peak_rss_mib": e2e["peak_rss_mib"]}]],
                               e2e["steps"] * int(self.distill["batch_size"]) * seq * L),
            distill_report.arm("healed", c["cross_entropy"]["student"], ce_u, ce_t, c.get("context_use"), *g, stages + [heal_stage],
                               block_passes + heal["steps"] * int(self.heal["batch_size"]) * seq * L),
        ]
        rep = {"name": self.name, "teacher": self.teacher, "ce_teacher": ce_t, "ce_untrained": ce_u, "arms": arms,
               "student_layers": L, "val_tokens": a["val_tokens"], "e2e_steps": e2e["steps"],
               "e2e_batch": int(self.distill["batch_size"]), "matched_steps": e2e["matched_steps"],
               "reports": {"blockwise": str(req["blockwise"].out_dir), "healed": str(req["healed"].out_dir)}}
        with self.building() as tmp:
            write_json(tmp / "report.json", rep)
            write_text(tmp / "report.md", distill_report.markdown(rep))
        print(f"\nReport: {self.out_dir / 'report.md'}\n\n" + distill_report.markdown(rep), flush=True)
