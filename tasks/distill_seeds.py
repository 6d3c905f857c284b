"""DistillSeedsReport: the distillation study over several seeds, one
:class:`~tasks.distill.DistillStudyReport` per seed and their comparisons pooled."""
from __future__ import annotations

import json

import luigi

from zgcore.atomic import write_json, write_text
from zgcore.evaluation.compare import SCORES, check_same_sequences, load_scores

from .base import HIDDEN, ZGTask
from .teacher import SharesUpstream
from .distill import DistillStudyReport


class DistillSeedsReport(SharesUpstream, ZGTask):
    """The distillation study over ``seeds``: one :class:`DistillStudyReport` per seed (its own
    blocks, end-to-end student and healing; the teacher cache is shared), then the arms' CE per
    seed and mean ± std, and comparisons pooled over seeds (``report.json``, ``report.md``)."""

    # 2: the seed-sign rule: a verdict with several seeds needs every seed's difference on its side ("why")
    # 3: method comparisons over training runs (fewer than 3: not resolved; Holm-adjusted), documents, FLOPs, plumbing checks
    # 4: the crossed run-level estimate, the document minimum, Holm-level intervals, gates undefined alike
    code_version = 4
    uses_device = False  # reads the per-seed reports only
    teacher = luigi.Parameter()
    corpus = luigi.DictParameter(visibility=HIDDEN)
    boundary = luigi.DictParameter(visibility=HIDDEN)
    eval = luigi.DictParameter(visibility=HIDDEN)
    studies = luigi.ListParameter(visibility=HIDDEN, description="per seed: {seed, blocks, heal, distill}")
    name = luigi.Parameter(default="distill-study", significant=False)

    def requires(self):
        return [self.shared(DistillStudyReport, boundary=self.boundary, blocks=st["blocks"], eval=self.eval,
                            heal=st["heal"], distill=st["distill"], name=self.name, device=self.device)
                for st in self.studies]

    def own_config(self):
        return {}

    def label(self):
        return "distill-seeds-" + "-".join(str(st["seed"]) for st in self.studies)

    def run(self):
        from zgcore.evaluation import distill_report

        seeds = [int(st["seed"]) for st in self.studies]
        reports = [json.loads((t.out_dir / "report.json").read_text()) for t in self.requires()]
        parts = [load_scores(t.out_dir / SCORES)["val"] for t in self.requires()]
        check_same_sequences([p["subset_sha256"] for p in parts], "seeds")
        rep = distill_report.seeds_report(self.name, seeds, reports, [p["ce"] for p in parts], groups=parts[0].get("documents"))
        rep["reports"] = [str(t.out_dir / "report.md") for t in self.requires()]
        with self.building() as tmp:
            write_json(tmp / "report.json", rep)
            write_text(tmp / "report.md", distill_report.seeds_markdown(rep))
