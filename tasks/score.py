"""Scoring as tasks keyed by what they read: one task per model and held-out set.

Each scoring task runs one model over one held-out set (the validation split of the corpus, its
test or its tuning rows, or one ``eval.extra`` corpus) and writes ``scores.json``: the
per-sequence cross-entropy with the rows and document ids it scored, on the validation split the
context use, and the model's layer and parameter counts (for FLOPs). Its hash covers only what the
score depends on:

* :class:`ScoreTeacher`: the teacher, the corpus and the scoring settings (never a block's
  training settings), so every experiment, study and library on one outputs folder scores a
  teacher once per corpus and settings;
* :class:`ScoreUntrained`: the teacher, the boundaries and each block's shape and initialisation
  (:func:`init_settings`; never its learning rate or steps);
* :class:`ScoreAssembled` (in :mod:`tasks.score_student`): the assembled (or healed) student, so
  a one-block change scores the new student only.

``Evaluate`` joins their outputs into the report and runs no model.
"""
from __future__ import annotations

import json
import time
from typing import Any
from collections.abc import Mapping

import luigi
import numpy as np

from zgcore.atomic import write_json
from zgcore.data import corpus
from zgcore.evaluation import flops, metrics
from zgcore.evaluation.compare import scores_part
from zgcore.hashing import canonical
from zgcore.training import mfu

from .base import HIDDEN
from .heldout import PrepareHeldOut, read_held_out
from .teacher import PrepareCorpus, _TeacherTask

SCORES = "scores.json"
METRICS = "metrics.json"
# the train settings that decide a block's untrained student (its shape and initial weights)
INIT_KEYS = ("n_layers", "keep_fraction", "keep", "importance_sequences", "intermediate_size", "kv_heads", "init", "seed")
# and, for a converted block only (tasks.blocks.mixer_of), its token mixer and window


def score_settings(eval_cfg: Mapping[str, Any], context: bool) -> dict[str, Any]:
    """The ``eval`` settings a score depends on: ``batch_size`` (sequences per forward),
    ``max_sequences`` and ``subset_seed`` (which rows), and with ``context`` (the validation
    split's test rows) ``context_sequences`` and, when it is not 0, ``context_window``. Gates,
    ``eval.extra`` and anything else never move a score's hash."""
    out = {k: int(eval_cfg[k]) for k in ("batch_size", "max_sequences", "subset_seed")}
    if context and int(eval_cfg.get("context_sequences", 0)):
        out["context_sequences"] = int(eval_cfg["context_sequences"])
        out["context_window"] = int(eval_cfg["context_window"])
    return out


def init_settings(train: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of :data:`INIT_KEYS` that take effect in one block's resolved ``train``
    settings (:func:`zgcore.config.experiment.effective_train`): what its untrained student is."""
    from zgcore.config.experiment import effective_train

    from .blocks import mixer_of

    t = effective_train(canonical(train))
    return {**{k: t[k] for k in INIT_KEYS if k in t}, **mixer_of(t)}


class _Score(_TeacherTask):
    """One model over one held-out set. Subclasses name the model (:meth:`model_requires`,
    :meth:`model_config`, :meth:`load_model`) and its report key (:attr:`key`)."""

    key = "model"
    corpus = luigi.DictParameter(visibility=HIDDEN)
    eval = luigi.DictParameter(visibility=HIDDEN, description="the eval settings (only score_settings is hashed)")
    held_out = luigi.DictParameter(default={}, visibility=HIDDEN,
                                   description="{} = the corpus's validation split; else one normalised eval.extra entry")
    rows = luigi.Parameter(default="test", description="test | tune: the validation rows in or outside the test subset")

    def data_task(self):
        if self.held_out:
            return self.shared(PrepareHeldOut, extra=self.held_out, seq_len=int(self.corpus["seq_len"]))
        return self.shared(PrepareCorpus)

    def model_requires(self) -> dict[str, Any]:
        return {}

    def model_config(self) -> dict[str, Any]:
        return {}

    def load_model(self):
        raise NotImplementedError

    def in_domain_test(self) -> bool:
        return not self.held_out and self.rows == "test"

    def requires(self):
        return {"teacher": self.teacher_task(), "data": self.data_task(), **self.model_requires()}

    def own_config(self):
        return {"eval": score_settings(self.eval, self.in_domain_test()), "held_out": dict(self.held_out),
                "rows": self.rows, **self.model_config()}

    def set_name(self) -> str:
        return self.held_out["name"] if self.held_out else "val" if self.rows == "test" else "tune"

    def label(self):
        return f"{self.key}-{self.set_name()}"

    def tokens(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(all rows [N, T], scored row indices [n], their document ids [n] or None)``."""
        data = self.data_task()
        if self.held_out:
            rows = read_held_out(data)
            idx = metrics.eval_subset(len(rows), int(self.eval["max_sequences"]), int(self.eval["subset_seed"]))
            row_docs = json.loads((data.out_dir / "meta.json").read_text()).get("row_documents")
            return rows, idx, None if row_docs is None else np.asarray(row_docs, dtype=np.int64)[idx]
        val = corpus.read_tokens(data.out_dir / "tokens.h5", "val")
        if self.rows == "tune":
            from .search import tune_rows

            idx = tune_rows(len(val), {k: self.eval[k] for k in ("max_sequences", "subset_seed")}, "a tuning-row score")
        else:
            idx = metrics.eval_subset(len(val), int(self.eval["max_sequences"]), int(self.eval["subset_seed"]))
        docs = corpus.read_documents(data.out_dir / "tokens.h5", "val")
        return val, idx, None if docs is None else docs[idx]

    def extra_outputs(self, model, tokens: np.ndarray) -> dict[str, Any]:
        """Anything else measured on the model (the student's sample); ``{}`` by default."""
        return {}

    def run(self):
        from zgcore.evaluation.flops import model_parameters

        all_rows, idx, docs = self.tokens()
        tokens = all_rows[idx]
        model = self.load_model()
        t0 = time.perf_counter()
        n_ctx = min(int(self.eval["context_sequences"]), len(tokens)) \
            if self.in_domain_test() and int(self.eval.get("context_sequences", 0)) else 0
        if hasattr(model, "precompute"):  # streamed (teacher_stream): every batch below, one layer at a time
            model.precompute(metrics.scoring_batches(tokens, int(self.eval["batch_size"]), n_ctx,
                                                     int(self.eval.get("context_window", 16))), head=True,
                             progress=lambda d, n: self.progress(d, n, f"{self.key} layer {d}/{n}"))
        per_seq = metrics.sequence_cross_entropy(model, tokens, int(self.eval["batch_size"]),
                                                 desc=f"CE {self.key} on {self.set_name()}")
        if not np.isfinite(per_seq).all():
            raise ValueError(f"{self.title()}: a held-out cross-entropy is not finite")
        cu = metrics.context_use(model, tokens[:n_ctx], int(self.eval["context_window"])) if n_ctx else None
        seconds = time.perf_counter() - t0
        par = model_parameters(model)
        work = flops.scoring_flops(par, len(tokens), tokens.shape[1], n_ctx, int(self.eval.get("context_window", 0)))
        out = {**scores_part({self.key: per_seq}, idx, docs), "of": int(len(all_rows)), "tokens": int(tokens.size),
               "seq_len": int(tokens.shape[1]), "context_use": cu, "context_sequences": n_ctx,
               "layers": int(model.config.get_text_config().num_hidden_layers), "parameters": par,
               **self.extra_outputs(model, tokens)}
        if self.held_out:
            meta = json.loads((self.data_task().out_dir / "meta.json").read_text())
            out.update({"name": meta["name"], "source": meta["source"]})
        with self.building() as tmp:
            write_json(tmp / SCORES, out)
            write_json(tmp / METRICS, {"seconds": seconds, **mfu.utilisation(work, seconds, self.device)})
        self.log(f"CE {float(per_seq.mean()):.4f} nats/token on {len(idx)} sequences of {self.set_name()}")


class ScoreTeacher(_Score):
    """The teacher's per-sequence held-out CE (and, on the test rows, its context use): keyed by
    teacher, corpus (or held-out corpus) and scoring settings only."""

    key = "teacher"

    def load_model(self):
        from zgcore.models.teacher_stream import activation_bytes, teacher_for

        from .teacher import teacher_record

        rec = teacher_record(self.teacher_task())
        n = int(self.eval.get("max_sequences") or 0) or 64  # the rows scored (at most), for the streamed plan
        act = activation_bytes(n, int(self.corpus["seq_len"]), rec["hidden_size"], "float32", 1)
        return teacher_for(rec, rec["n_layers"], "float32", self.device, head=True, activations=act)


class ScoreUntrained(_Score):
    """The untrained student's scores: the teacher's embedding and head around each block as
    initialised before training. Keyed by teacher, boundaries and each block's
    :func:`init_settings`; the blocks are built here exactly as ``TrainBlock`` builds them
    (same seed, kept layers and measurements), so no block needs training first."""

    key = "untrained"
    boundary = luigi.DictParameter(visibility=HIDDEN)
    blocks = luigi.ListParameter(visibility=HIDDEN, description="each block's resolved train settings (init keys hashed)")

    def model_requires(self):
        from zgcore.models import students

        from .students import layer_importance

        need = [t for t in self.blocks if students.needs_measure(t)]
        return {"importance": [layer_importance(self, t) for t in need]} if need else {}

    def model_config(self):
        from .cache import cache_settings

        bd = cache_settings(self.boundary)
        return {"boundaries": {k: bd[k] for k in ("num_blocks", "boundaries")}, "blocks": [init_settings(t) for t in self.blocks]}

    def load_model(self):
        from zgcore.device import resolve
        from zgcore.models import students
        from zgcore.models.adapters import build_block
        from zgcore.models.hetero import assemble_student
        from zgcore.models.shapes import kept_layers, resolve_boundaries
        from zgcore.models.teacher_weights import layer_source
        from zgcore.training.blocks import block_seed

        from .blocks import mixer_of
        from .students import layer_importance
        from .teacher import teacher_record

        rec, (teacher, _tok) = self.load_teacher()
        bs = resolve_boundaries(self.boundary, rec["n_layers"])
        source, blocks = layer_source(teacher_record(self.teacher_task())), []
        for i, t in enumerate(self.blocks):
            measured = (json.loads((layer_importance(self, t).out_dir / "importance.json").read_text())
                        if students.needs_measure(t) else {})
            kept = kept_layers(bs[i], bs[i + 1], t, measured.get("influence"))
            blocks.append(build_block(source, kept, t["init"], block_seed(int(t["seed"]), i), device=resolve(self.device),
                                      intermediate_size=t.get("intermediate_size"), channels=measured.get("channels"),
                                      kv_heads=t.get("kv_heads"), **mixer_of(t)))
        return assemble_student(teacher, blocks)
