"""Assemble: the teacher's embedding, the trained blocks in order, and the teacher's final norm
and LM head stitched into one Hugging Face model; ``_StudentTask``, the base of every task over
one student's blocks."""
from __future__ import annotations

import luigi

from zgcore.models.hetero import assemble_student, save_student

from .base import HIDDEN
from .blocks import TrainBlock, load_blocks
from .teacher import _TeacherTask


class _StudentTask(_TeacherTask):
    corpus = luigi.DictParameter(visibility=HIDDEN)
    boundary = luigi.DictParameter(visibility=HIDDEN)
    blocks = luigi.ListParameter(visibility=HIDDEN, description="each block's resolved train settings, in block order")

    def study_name(self) -> str:
        """The experiment or study this task was built for: ``study``, else the task's own ``name``
        (Evaluate, DistillStudyReport), else ``""``; its training tasks' TensorBoard runs go under it."""
        return str(self.study or getattr(self, "name", "") or "")

    def block_tasks(self) -> list[TrainBlock]:
        return [self.shared(TrainBlock, boundary=self.boundary, block=i, train=t, study=self.study_name(),
                            device=self.device) for i, t in enumerate(self.blocks)]


class Assemble(_StudentTask):
    """Stitch the teacher's embedding, the trained blocks in order, and the teacher's final norm and
    LM head into one Hugging Face model folder (config, safetensors, tokenizer; a converted student's
    folder also carries its modelling code: :mod:`zgcore.models.hf_converted_llama`)."""

    def requires(self):
        return {"teacher": self.teacher_task(), "blocks": self.block_tasks()}

    def own_config(self):
        return {}

    def label(self):
        return "student"

    def run(self):
        rec, (model, tok) = self.load_teacher()
        student = assemble_student(model, load_blocks(model, self.requires()["blocks"], "block"))
        with self.building() as tmp:
            save_student(student, tok, tmp / "model")
        self.log(f"saved {self.out_dir / 'model'}")
