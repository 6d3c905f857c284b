"""Aggregate tasks: several seeds of one experiment, and the objective study's comparison report."""
from __future__ import annotations

import json

import luigi

from zgcore.evaluation import plots, study
from zgcore.atomic import write_json, write_text
from zgcore.evaluation.compare import SCORES, check_same_sequences, load_scores

from .base import HIDDEN, ZGTask
from .teacher import SharesUpstream
from .evaluate import Evaluate


def student_scores(e: Evaluate) -> dict:
    """The held-out split's per-sequence CE of a finished Evaluate: ``{"teacher", "untrained",
    "student": float64 [n]}`` (nats/token), and ``"subset_sha256"``, the rows it scored."""
    d = load_scores(e.out_dir / SCORES)["val"]
    return {**d["ce"], "subset_sha256": d["subset_sha256"], "documents": d.get("documents")}


class _ManyEvaluations(SharesUpstream, ZGTask):
    # 2: comparisons (paired bootstrap over held-out sequences, pooled over seeds) from Evaluate's per_sequence_ce.json
    # 3: the seed-sign rule: a verdict with several seeds needs every seed's difference on its side ("why")
    # 4: method comparisons over training runs (fewer than 3: not resolved; Holm-adjusted); a random teacher: descriptive
    # 5: the crossed run-level estimate, the document minimum, Holm-level intervals; training FLOPs per arm; gates undefined alike
    code_version = 5
    uses_device = False  # reads the Evaluate reports only
    teacher = luigi.Parameter()
    corpus = luigi.DictParameter(visibility=HIDDEN)
    boundary = luigi.DictParameter(visibility=HIDDEN)
    eval = luigi.DictParameter(visibility=HIDDEN)
    name = luigi.Parameter(default="experiment", significant=False)

    def evaluate(self, blocks) -> Evaluate:
        """The Evaluate task of one set of per-block train settings."""
        return self.shared(Evaluate, boundary=self.boundary, blocks=blocks, eval=self.eval, name=self.name,
                           device=self.device)

    def own_config(self):
        return {}


class SeedSummary(_ManyEvaluations):
    """Mean ± std over seeds of one experiment (each seed its own blocks and student; one cache)."""

    seeds = luigi.ListParameter()
    blocks_per_seed = luigi.ListParameter(visibility=HIDDEN, description="per seed: each block's resolved train settings")

    def requires(self):
        return [self.evaluate(b) for b in self.blocks_per_seed]

    def label(self):
        return "seeds-" + "-".join(str(s) for s in self.seeds)

    def run(self):
        reports = [json.loads((e.out_dir / "report.json").read_text()) for e in self.requires()]
        scores = [student_scores(e) for e in self.requires()]
        check_same_sequences([s["subset_sha256"] for s in scores], "seeds")
        summary = study.seed_summary(reports, list(self.seeds), scores)
        summary["reports"] = [str(e.out_dir / "report.md") for e in self.requires()]
        with self.building() as tmp:
            write_json(tmp / "report.json", summary)
            write_text(tmp / "report.md", study.seed_markdown(summary, self.name)
                       + "\nPer-seed reports:\n\n" + "\n".join(f"- {p}" for p in summary["reports"]) + "\n")


class ObjectiveStudyReport(_ManyEvaluations):
    """One comparison report over the study's arms ({clean, noisy, denoise} x {cached, online} x seeds)."""

    # 6: a study without online arms says the byte-for-byte check was not made (it printed an empty list)
    # 7: no local reduction for attention-transfer blocks (first and final losses are different quantities)
    # 8: a conversion study's report is titled so and names its mixer and window (it read "objective study")
    code_version = 8
    arms = luigi.ListParameter(visibility=HIDDEN, description="[{objective, targets, seed, blocks}]")

    def requires(self):
        evals = [self.evaluate(a["blocks"]) for a in self.arms]
        # each arm's block weights are compared byte for byte here
        req = {"evaluations": evals, "blocks": [e.block_tasks() for e in evals]}
        if any(b["targets"] == "cached" for a in self.arms for b in a["blocks"]):  # its manifest: the cache build's FLOPs
            from .cache import TeacherBoundary

            req["cache"] = self.shared(TeacherBoundary, boundary=self.boundary, device=self.device)
        return req

    def label(self):
        return "objective-study"

    def run(self):
        seeds = {a["seed"] for a in self.arms}
        req = self.requires()
        arms = []
        manifest = json.loads((req["cache"].out_dir / "manifest.json").read_text()) if "cache" in req else None
        n_cache = int(manifest["n_train"]) + int(manifest["n_val"]) if manifest else None
        for a, ev, blocks in zip(self.arms, req["evaluations"], req["blocks"]):
            rep = json.loads((ev.out_dir / "report.json").read_text())
            arms.append({"objective": a["objective"], "targets": a["targets"], "seed": a["seed"], "multi_seed": len(seeds) > 1,
                         "report": rep, "flops": study.blockwise_flops(rep, [int(b["batch_size"]) for b in a["blocks"]], n_cache),
                         "scores": student_scores(ev)["student"], "subset": student_scores(ev)["subset_sha256"],
                         "documents": student_scores(ev)["documents"],
                         "block_files": [b.out_dir / "block.safetensors" for b in blocks]})
        check_same_sequences([a["subset"] for a in arms], "objective study's arms")
        result = study.objective_study(arms)
        with self.building() as tmp:
            write_json(tmp / "report.json", result)
            write_text(tmp / "report.md", study.study_markdown(result))
            plots.arms(result["rows"], tmp / "arms.png", teacher=result["rows"][0]["ce_teacher"])
