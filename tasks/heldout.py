"""PrepareHeldOut: one out-of-domain held-out corpus (``eval.extra``) tokenised with the teacher's
tokenizer. Only evaluation tasks require it: nothing that trains reads it or hashes it."""
from __future__ import annotations

import sys

import luigi
import numpy as np

from zgcore.data import heldout
from zgcore.evaluation import heldout_score
from zgcore.atomic import write_json
from zgcore.data.sources import stdlib_root

from .base import HIDDEN
from .teacher import _TeacherTask, path_stamp, teacher_tokenizer

TOKENS = "tokens.npy"  # int32 [n, seq_len]


class PrepareHeldOut(_TeacherTask):
    """Tokenise one ``eval.extra`` corpus (:func:`zgcore.evaluation.heldout_score.tokenize_extra`) into rows of
    ``seq_len`` tokens, every row held out: ``tokens.npy`` (int32 ``[n, seq_len]``) and
    ``meta.json`` (name, source, documents, characters, tokens, rows, fingerprint, row_documents)."""

    uses_device = False  # tokenises only
    code_version = 2  # 2: meta.json records each row's document id (row_documents), so comparisons resample documents

    extra = luigi.DictParameter(visibility=HIDDEN, description="one normalised eval.extra entry")
    seq_len = luigi.IntParameter(description="tokens per row (the experiment's corpus.seq_len)")

    def requires(self):
        return self.teacher_task()

    def own_config(self):
        src = self.extra["source"]
        if src in ("stdlib-docstrings", "python-stdlib"):  # the text of this Python's standard library
            stamps = [sys.version, str(stdlib_root())]
        elif src == "pydoc":
            stamps = [sys.version]
        else:
            from zgcore.config.experiment import corpus_files

            stamps = [path_stamp(str(f)) for f in corpus_files({"source": src, "text_field": self.extra["text_field"]})]
        return {"extra": dict(self.extra), "seq_len": int(self.seq_len), "stamps": stamps}

    def label(self):
        return f"{self.extra['name']}-T{self.seq_len}"

    def run(self):
        tok = teacher_tokenizer(self.teacher_task())
        rows, meta = heldout_score.tokenize_extra(dict(self.extra), tok, int(self.seq_len))
        with self.building() as tmp:
            np.save(tmp / TOKENS, rows)
            write_json(tmp / "meta.json", meta)
        self.log(f"{meta['characters']:,} characters -> {meta['rows']} held-out sequences of {self.seq_len} tokens")


def held_out_tasks(task, eval_cfg) -> list[PrepareHeldOut]:
    """The PrepareHeldOut tasks of an evaluation task's ``eval.extra`` (``task`` has ``teacher``,
    ``corpus``, ``outputs``), in the configured order."""
    return [task.shared(PrepareHeldOut, extra=e, seq_len=int(task.corpus["seq_len"]))
            for e in heldout.extra_corpora(eval_cfg)]


def read_held_out(task: PrepareHeldOut) -> np.ndarray:
    """A finished PrepareHeldOut's rows as int64 ``[n, seq_len]``."""
    return np.load(task.out_dir / TOKENS).astype(np.int64)
