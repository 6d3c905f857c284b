"""The first stage of the experiment graph: PrepareTeacher (the teacher, loadable offline) and
PrepareCorpus (the corpus tokenised with the teacher's tokenizer), and what every task that loads
the teacher shares (:func:`teacher_record`, ``_TeacherTask``)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import luigi

from zgcore.data import corpus
from zgcore.models import teacher as zteacher
from zgcore.atomic import register_temp_root, write_json
from zgcore.config.experiment import corpus_files
from zgcore.data.sources import stdlib_root

from .base import HIDDEN, ZGTask

# the teacher cache (zgcore.models.teacher.materialise: built tiny teachers, the fetched GGUF) lies
# outside every task folder: every task's start sweeps it for a killed writer's temporaries
TEACHER_CACHE = register_temp_root("teachers")


def path_stamp(spec: str) -> list | None:
    """(name, size, mtime) of a local file or the files of a local folder; None for other specs.
    Part of a task's hash so that editing a local teacher or corpus file rebuilds what depends on it."""
    p = Path(os.path.expanduser(str(spec)))
    if not p.exists():
        return None
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file())
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


class PrepareTeacher(ZGTask):
    """Make the teacher loadable offline: fetch/checksum the built-in GGUF and convert it to a
    Hugging Face folder (so later tasks load in seconds), build tiny teachers, or record a local one."""

    uses_device = False  # de-quantises on CPU

    teacher = luigi.Parameter(description="smollm2-135m | tiny-llama | tiny-qwen2 | tiny-gpt2 | HF folder | .gguf | Hub id")

    def own_config(self):
        return {"teacher": self.teacher, "stamp": path_stamp(self.teacher)}

    def label(self):
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(str(self.teacher)).name)[:40] or "teacher"

    def run(self):
        record = zteacher.materialise(self.teacher, self.outputs, log=self.log)
        with self.building() as tmp:
            if record.get("gguf_file"):
                self.log(f"de-quantising {record['gguf_file']} into a Hugging Face folder (once)")
                model, tok = zteacher.load(record)
                model.save_pretrained(tmp / "model")
                tok.save_pretrained(tmp / "model")
                record = {**record, "source_path": record["path"], "path": "model", "gguf_file": None}
            zteacher.save_record(tmp / "teacher.json", record)


def teacher_record(task: PrepareTeacher) -> dict[str, Any]:
    """A prepared teacher's record with ``path`` made absolute."""
    rec = zteacher.read_record(task.out_dir / "teacher.json")
    if rec["path"] == "model":
        rec["path"] = str((task.out_dir / "model").resolve())
    return rec


def teacher_tokenizer(task: PrepareTeacher):
    """The prepared teacher's tokenizer (``AutoTokenizer``, from its GGUF file when it has one):
    the one tokenizer every corpus of an experiment is cut with."""
    from transformers import AutoTokenizer

    rec = teacher_record(task)
    kw = {"gguf_file": rec["gguf_file"]} if rec.get("gguf_file") else {}
    return AutoTokenizer.from_pretrained(rec["path"], **kw)


SHARED = ("teacher", "corpus", "outputs")  # the upstream parameters SharesUpstream.shared passes on


class SharesUpstream:
    """Mixin for a task with the experiment's ``teacher``, ``corpus`` and ``outputs`` parameters
    (:data:`SHARED`): its upstream tasks get them passed once, by :meth:`shared`."""

    def shared(self, cls, **kw):
        """``cls(**kw)`` with this task's teacher, corpus and outputs (the parameters every task of an
        experiment shares, passed once; of them those ``cls`` takes and ``kw`` does not name): what
        gokart's ``clone`` does, for that family only, so no other parameter (``device``) passes unasked."""
        names = set(cls.get_param_names(include_significant=True))
        return cls(**{k: getattr(self, k) for k in SHARED if k in names and k not in kw and hasattr(self, k)}, **kw)

    def shared_params(self, **kw) -> dict:
        """This task's teacher, corpus and outputs, and ``kw``: keyword arguments for several upstream tasks."""
        return {**{k: getattr(self, k) for k in SHARED}, **kw}


class _TeacherTask(SharesUpstream, ZGTask):
    teacher = luigi.Parameter()
    # names the folder of the task's TensorBoard run (<outputs>/tensorboard/<study>/<family>/<run>), never
    # its output: a block shared by two experiments is one task, named after the first that asks for it
    study = luigi.Parameter(default="", significant=False, visibility=HIDDEN,
                            description="the experiment or study this task was built for (its TensorBoard folder)")

    def load_teacher(self):
        rec = teacher_record(self.teacher_task())
        return rec, zteacher.load(rec, self.device)

    def teacher_task(self) -> PrepareTeacher:
        return PrepareTeacher(teacher=self.teacher, outputs=self.outputs)


class PrepareCorpus(_TeacherTask):
    """Tokenize the corpus with the teacher's tokenizer into fixed-length train/val sequences (HDF5)."""

    uses_device = False  # tokenises only
    code_version = 2  # 2: each row's document id in the token store (format 2)

    corpus = luigi.DictParameter(visibility=HIDDEN)

    def requires(self):
        return self.teacher_task()

    def own_config(self):
        src = self.corpus["source"]
        if src == "pydoc":
            stamps = None
        elif src == "python-stdlib":  # the files of this Python's standard library
            import sys

            stamps = [sys.version, str(stdlib_root())]
        else:
            stamps = [path_stamp(str(f)) for f in corpus_files(self.corpus)]
        # buffer_tokens bounds memory only: the same tokens for any value, so it never moves the hash
        return {"corpus": {k: v for k, v in self.corpus.items() if k != "buffer_tokens"}, "stamps": stamps}

    def label(self):
        return f"corpus-T{self.corpus['seq_len']}"

    def run(self):
        rec, tok = teacher_record(self.teacher_task()), teacher_tokenizer(self.teacher_task())
        capped: list[str] = []
        with self.building() as tmp:
            meta = corpus.build_token_store(tmp / "tokens.h5", self.corpus, tok, rec["spec"], rec["max_positions"],
                                            log=self.log, cap_note=capped.append)
            write_json(tmp / "meta.json", meta)
        # the one line that names the corpus; with corpus.max_tokens it says which files filled it
        src = self.corpus["source"]
        self.log(f"corpus {', '.join(map(str, src)) if isinstance(src, (list, tuple)) else src}: {meta['tokens']} tokens"
                 + f" -> {meta['n_train']} train + {meta['n_val']} val sequences of {meta['seq_len']}"
                 + (f"; {meta['skipped_files']} unusable file(s) skipped" if meta["skipped_files"] else "")
                 + "".join(f"; {c}" for c in capped))
