"""LibraryReport: the top of the library graph. Its static inputs are every candidate's score,
every budget's selection and the uniform students' evaluations; the selected students' assembly
and evaluation are known only once the selections are, so ``run`` yields them (dynamic
dependencies), each named by its chosen candidates — a budget whose choice is unchanged finds its
student already built."""
from __future__ import annotations

import json
from pathlib import Path

import luigi

from zgcore.atomic import write_json, write_text
from zgcore.evaluation import library_report as zlib
from zgcore.evaluation.compare import SCORES, load_scores
from zgcore.evaluation.flops import blocks_training_flops
from zgcore.evaluation.report import random_teacher_note

from .base import HIDDEN, ZGTask
from .teacher import SharesUpstream
from .library import ScoreCandidate, ScoreStudent, SelectBudget, read_candidate


class LibraryReport(SharesUpstream, ZGTask):
    """``report.json`` (``"selections": [{"budget", "chosen", "params", "ce", "model", ...}]``,
    ``"candidates"``, ``"uniform"``, ``"comparisons"``), ``report.md`` and ``quality_size.png``.

    Parameters hold the resolved plan (``workflows.library``): per partition the candidates'
    train settings and names, the uniform students (a variant index per partition), the budgets
    (absolute, with what the user wrote) and their unit, and the teacher's cost."""

    uses_device = False
    # 2: comparisons as trained configurations (one seed: not resolved), documents resampled, Holm over the report,
    #    FLOPs/token and training FLOPs per arm, the random-teacher banner; budgets never in scientific notation
    code_version = 2
    teacher = luigi.Parameter()
    corpus = luigi.DictParameter(visibility=HIDDEN)
    boundary = luigi.DictParameter(visibility=HIDDEN)
    eval = luigi.DictParameter(visibility=HIDDEN)
    candidates = luigi.ListParameter(visibility=HIDDEN, description="per partition: [{train, name}]")
    uniform = luigi.ListParameter(visibility=HIDDEN, description="[{name, indices}]: one variant at every partition")
    budgets = luigi.ListParameter(visibility=HIDDEN, description="[{raw, budget}]")
    unit = luigi.Parameter(default="params")
    teacher_cost = luigi.DictParameter(visibility=HIDDEN)
    name = luigi.Parameter(default="library", significant=False)
    context = luigi.IntParameter(default=0, description="library.context: decode tokens at which kv_bytes are counted (0: per token)")

    def _kw(self):
        # where the tasks below work (this one only aggregates)
        return self.shared_params(boundary=self.boundary, device=self.device)

    def _ctx(self):
        return {"context": int(self.context)} if int(self.context) else {}  # candidates' kv_bytes at library.context

    def tune(self):
        return {"max_sequences": int(self.eval["max_sequences"]), "subset_seed": int(self.eval["subset_seed"])}

    def score_tasks(self) -> list[list[ScoreCandidate]]:
        return [[ScoreCandidate(block=i, train=c["train"], tune=self.tune(), study=self.name, **self._kw(), **self._ctx())
                 for c in part]
                for i, part in enumerate(self.candidates)]

    def score_params(self) -> list[list[dict]]:
        return [[dict(block=i, train=c["train"], tune=self.tune(), **self._kw(), **self._ctx()) for c in part]
                for i, part in enumerate(self.candidates)]

    def student(self, indices) -> ScoreStudent:
        """The evaluation of the student made of candidate ``indices[i]`` at every partition ``i``."""
        return ScoreStudent(blocks=[self.candidates[i][v]["train"] for i, v in enumerate(indices)], eval=self.eval,
                            study=self.name, **self._kw())

    def requires(self):
        return {"candidates": self.score_tasks(),
                "selections": [SelectBudget(candidates=self.score_params(), budget=float(b["budget"]), unit=self.unit,
                                            outputs=self.outputs) for b in self.budgets],
                "uniform": [self.student(u["indices"]) for u in self.uniform]}

    def own_config(self):
        return {"budgets_raw": [float(b["raw"]) for b in self.budgets], "names": [[c["name"] for c in p] for p in self.candidates]}

    def label(self):
        return "library-report"

    def chosen(self) -> list[list[int]] | None:
        """Each budget's chosen variant indices, once every selection is done (else None)."""
        sels = self.requires()["selections"]
        if not all(s.complete() for s in sels):
            return None
        return [json.loads((s.out_dir / "selection.json").read_text())["chosen"] for s in sels]

    def dynamic_upstream(self):
        chosen = self.chosen()
        return [self.student(c) for c in chosen] if chosen is not None else []

    def run(self):
        req = self.requires()
        chosen = self.chosen()
        students = [self.student(c) for c in chosen]
        yield students
        cands = [[read_candidate(t) for t in part] for part in req["candidates"]]
        table = [{"partition": i, "name": self.candidates[i][v]["name"], "variant": v,
                  **{k: c[k] for k in ("kept", "intermediate_size", "kv_heads", "params", "flops", "kv_bytes", "ce",
                                       "ce_teacher", "ce_increase", "block_loss", "tune_sequences")}}
                 for i, part in enumerate(cands) for v, c in enumerate(part)]
        seq = int(self.corpus["seq_len"])

        def train_flops(indices) -> int:  # the chosen candidates' block training, student side (zgcore.evaluation.flops)
            steps = [json.loads((Path(cands[i][v]["block_dir"]) / "metrics.json").read_text())["steps"]
                     for i, v in enumerate(indices)]
            return blocks_training_flops([{"steps": n, "batch_size": self.candidates[i][v]["train"]["batch_size"],
                                           "forward": cands[i][v]["flops"]} for n, (i, v) in zip(steps, enumerate(indices))], seq)

        selections, scores = [], {}
        for b, sel_task, st in zip(self.budgets, req["selections"], students):
            sel = json.loads((sel_task.out_dir / "selection.json").read_text())
            ce = json.loads((st.out_dir / "ce.json").read_text())
            if ce["params"] != sel["params"]:
                raise RuntimeError(f"assembled student {ce['model']} has {ce['params']:,} non-embedding parameters, "
                                   f"the selection {sel['params']:,}: assembly padded or dropped weights")
            scores[ce["model"]] = load_scores(st.out_dir / SCORES)
            selections.append({"budget": float(b["budget"]), "budget_raw": float(b["raw"]), "unit": self.unit,
                               "chosen": [self.candidates[i][v]["name"] for i, v in enumerate(sel["chosen"])],
                               "indices": sel["chosen"], "params": sel["params"], "flops": sel["flops"],
                               "kv_bytes": sel["kv_bytes"], "predicted_increase": sel["delta"], "ce": ce["ce"],
                               "extra": ce["extra"], "model": ce["model"], "train_flops": train_flops(sel["chosen"])})
        uniform = []
        for u, t in zip(self.uniform, req["uniform"]):
            ce = json.loads((t.out_dir / "ce.json").read_text())
            scores[ce["model"]] = load_scores(t.out_dir / SCORES)
            extra = cands[0][0]["student_extra"]
            cost = {k: extra[k] + sum(cands[i][v][k] for i, v in enumerate(u["indices"])) for k in ("params", "flops", "kv_bytes")}
            uniform.append({"name": u["name"], "indices": list(u["indices"]), "params": ce["params"], "cost": cost,
                            "ce": ce["ce"], "extra": ce["extra"], "model": ce["model"], "train_flops": train_flops(u["indices"])})
        seed = int(self.candidates[0][0]["train"]["seed"])
        note = random_teacher_note(self.teacher)  # a random teacher: the banner, and no verdict
        report = {"name": self.name, "teacher": self.teacher, "seq_len": int(self.corpus["seq_len"]), "budget_unit": self.unit,
                  "teacher_cost": dict(self.teacher_cost), "candidates": table, "selections": selections,
                  "uniform": uniform, "teacher_note": note, "descriptive": note is not None,
                  "comparisons": zlib.comparisons(selections, uniform, self.unit, scores, seed, plumbing=note is not None)}
        with self.building() as tmp:
            write_json(tmp / "report.json", report)
            write_text(tmp / "report.md", zlib.markdown(report))
            zlib.plot(selections, uniform, tmp / "quality_size.png", self.teacher_cost["params"])
