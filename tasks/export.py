"""ExportGGUF: a student's Hugging Face folder as one GGUF file that llama.cpp runs
(:mod:`zgcore.models.gguf_export`), at f32, f16 or quantized by llama.cpp (q8_0, q4_k_m)."""
from __future__ import annotations

import json
from pathlib import Path

import luigi

from zgcore.atomic import write_json
from zgcore.models import gguf_export

from .assemble import Assemble, _StudentTask
from .base import HIDDEN
from .heal import Heal
from .library import AssembleExact
from .teacher import teacher_record

GGUF = "model.gguf"
RECORD = "export.json"


def teacher_gguf(record: dict) -> Path | None:
    """The teacher's own GGUF file, when it came as one (``smollm2-135m`` or a ``.gguf`` path), else ``None``."""
    from zgcore.models.teacher import SMOLLM2

    spec = str(record.get("spec", ""))
    if spec == "smollm2-135m" and record.get("source_path"):
        return Path(record["source_path"]) / Path(SMOLLM2["member"]).name
    if spec.endswith(".gguf"):
        return Path(spec).expanduser().resolve()
    return None


class ExportGGUF(_StudentTask):
    """The student as ``model.gguf`` for llama.cpp (Ollama, LM Studio), with ``export.json``
    ``{"arch", "quant", "bytes", "mixers", "widths", "heads", "kv_heads", "tensors", "tokenizer"}``.

    The student is the healed one when ``heal.steps`` > 0, the one assembled without padding
    (:class:`tasks.library.AssembleExact`, a library's pick) with ``exact``, else the assembled one.
    The tokenizer keys are the teacher's GGUF's, unchanged, when the teacher came as a GGUF."""

    uses_device = False  # converts on CPU
    heal = luigi.DictParameter(default={"steps": 0}, visibility=HIDDEN,
                               description="heal section; steps > 0 exports the healed student (tasks.heal.Heal)")
    exact = luigi.BoolParameter(default=False,
                                description="export the student assembled without padding (AssembleExact)")
    quant = luigi.Parameter(default="f32", description="f32 | f16 | q8_0 | q4_k_m")

    def student_task(self):
        kw = dict(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary, blocks=self.blocks,
                  study=self.study_name(), outputs=self.outputs, device=self.device)
        if self.exact:
            return AssembleExact(**kw)
        return Heal(heal=self.heal, **kw) if int(self.heal.get("steps", 0)) else Assemble(**kw)

    def requires(self):
        return {"student": self.student_task(), "teacher": self.teacher_task()}

    def own_config(self):
        return {"quant": str(self.quant), "exact": bool(self.exact)}

    def label(self):
        return f"student-{self.quant}"

    def run(self):
        folder = self.requires()["student"].out_dir / "model"
        source = teacher_gguf(teacher_record(self.teacher_task()))
        with self.building() as tmp:
            rec = gguf_export.export(folder, tmp / GGUF, str(self.quant), source, threads=1)
            write_json(tmp / RECORD, {**rec, "tokenizer": f"teacher GGUF {source.name}" if source else "tokenizer.json",
                                      "student": str(folder)})
        self.log(f"wrote {self.out_dir / GGUF} ({rec['arch']}, {self.quant}, {rec['bytes'] / 1e6:.1f} MB)")


def read_export(task: ExportGGUF) -> dict:
    """A finished export's ``export.json``."""
    return json.loads(task.checked(RECORD).read_text())
