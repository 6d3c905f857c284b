"""LayerImportance: the teacher measured once on a few training sequences, for students shaped
by measurement (``train.keep = "importance"``, ``train.intermediate_size``)."""
from __future__ import annotations

import luigi

from zgcore.data import corpus
from zgcore.models import students
from zgcore.atomic import write_json

from .base import HIDDEN
from .teacher import PrepareCorpus, _TeacherTask


class LayerImportance(_TeacherTask):
    """Block influence of every teacher layer (ShortGPT) and mean |activation| of every MLP
    channel (Minitron) on the first ``sequences`` training sequences; ``importance.json``."""

    corpus = luigi.DictParameter(visibility=HIDDEN)
    sequences = luigi.IntParameter(description="training sequences measured")

    def requires(self):
        return {"teacher": self.teacher_task(),
                "corpus": self.shared(PrepareCorpus)}

    def own_config(self):
        return {"sequences": self.sequences}

    def label(self):
        return f"importance-n{self.sequences}"

    def run(self):
        _rec, (model, _tok) = self.load_teacher()
        tokens = corpus.read_tokens(self.requires()["corpus"].out_dir / "tokens.h5", "train")[: self.sequences]
        m = students.measure(model, tokens)
        ranking = sorted(range(len(m["influence"])), key=lambda i: -m["influence"][i])
        with self.building() as tmp:
            write_json(tmp / "importance.json", {**m, "sequences": len(tokens), "ranking": ranking})
        self.log("block influence by layer: " + " ".join(f"{i}:{v:.3f}" for i, v in enumerate(m["influence"])))


def layer_importance(task, train) -> LayerImportance:
    """The ``LayerImportance`` task that ``task`` (one with teacher, corpus, outputs and device
    parameters) reads for a block of train settings ``train`` (its ``importance_sequences``)."""
    return task.shared(LayerImportance, device=task.device, sequences=int(train["importance_sequences"]))
