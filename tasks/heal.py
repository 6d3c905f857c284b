"""Healing: ``Heal``, a short end-to-end logit-KD stage of the assembled student, and
``_DistillTask``, the run it shares with the distillation study's end-to-end arm (:mod:`tasks.distill`)."""
from __future__ import annotations

import json
from typing import Any

import luigi

from zgcore.data import corpus
from zgcore.training import distill as zdistill
from zgcore.evaluation import flops
from zgcore.training import mfu
from zgcore.atomic import write_json
from zgcore.training.loop import FINAL_STATE, LOSS_LOG
from zgcore.training.memory import PeakRSS

from .assemble import Assemble, _StudentTask
from .base import HIDDEN
from .teacher import PrepareCorpus
from .work import Resumable


def heal_hashed(h) -> dict[str, Any]:
    """The healing settings a result depends on, as :class:`zgcore.config.schema.Heal` declares them
    (``checkpoint_every``, ``log_every`` and ``tensorboard`` are not; nor ``top_k`` when 0 or ``targets`` when
    ``"online"``, the defaults: healed students from before they existed keep their names)."""
    from zgcore.config.fields import hashed_view
    from zgcore.config.schema import Heal

    return hashed_view(Heal, h)  # the rules are the settings' declarations


class _DistillTask(Resumable, _StudentTask):
    """Shared run of the end-to-end distillation tasks: train a student model on the teacher's
    logits with :func:`zgcore.training.distill.distill` and save it as a Hugging Face folder ``model/``
    with ``metrics.json`` (incl. ``peak_rss_mib``), ``loss_log.csv`` and ``train_state.pt``.

    With ``targets = "cached"`` the targets are read from the top-k logit store
    (:class:`tasks.logits.TeacherLogitStore`, required as ``"logits"``) and the teacher is never
    loaded: no layer of it beyond what the student is built from, its tokenizer only."""

    section = "heal"  # the configuration section of settings(), named in errors

    def corpus_task(self) -> PrepareCorpus:
        return self.shared(PrepareCorpus)

    def settings(self) -> dict[str, Any]:
        """The distillation settings (as :data:`zgcore.config.defaults.HEAL_DEFAULTS`)."""
        raise NotImplementedError

    def start_student(self, teacher):
        """``(student, pairs, extra_metrics)``: the model to train, hidden-term layer pairs, metrics
        to record. ``teacher``: the loaded teacher, or ``None`` with cached targets."""
        raise NotImplementedError

    def section_settings(self) -> dict[str, Any]:
        """The configuration section as given (``heal`` or ``distill``; the step count unresolved)."""
        return dict(getattr(self, self.section))

    def cached(self) -> bool:
        """Whether the targets come from the top-k logit store."""
        return self.section_settings().get("targets", "online") == "cached"

    def logit_requires(self) -> dict[str, Any]:
        """``{"logits": TeacherLogitStore}`` with cached targets, else ``{}``."""
        from .logits import logit_store_task

        return {"logits": logit_store_task(self, self.section_settings())} if self.cached() else {}

    def run(self):
        from .teacher import teacher_tokenizer

        with PeakRSS() as rss:
            store = None
            if self.cached():  # the tokenizer only: the targets are in the store
                teacher, tok = None, teacher_tokenizer(self.teacher_task())
                store = self.requires()["logits"].out_dir
            else:  # the whole teacher, or (teacher_stream) its layers one at a time, every step
                from zgcore.models.teacher_stream import teacher_for

                from .teacher import teacher_record

                rec, tok = teacher_record(self.teacher_task()), teacher_tokenizer(self.teacher_task())
                teacher = teacher_for(rec, rec["n_layers"], "float32", self.device, head=True)
            tokens = corpus.read_tokens(self.corpus_task().out_dir / "tokens.h5", "train")
            student, pairs, extra = self.start_student(teacher)
            h = self.settings()
            seq_len = int(self.corpus["seq_len"])
            # training FLOPs per token: the student forward and backward, the teacher's forward when it runs online
            par = (flops.model_parameters(student), flops.model_parameters(teacher) if teacher is not None else None)
            cost = lambda steps, batch: flops.heal_flops(seq_len, par[1], par[0], steps, batch,  # noqa: E731
                                                         store_sequences=None if par[1] is not None else 0)["total"]
            per_token = cost(1, 1) / seq_len
            run = zdistill.DistillRun(h, int(h["steps"]), int(h["seed"]), self.work_dir, self.uid,
                                      pairs=pairs, name=self.title(), section=self.section,
                                      progress=lambda s, n, v: self.progress(s, n, f"step {s}/{n} loss {v[0]:.4f}"),
                                      callbacks=self.watchers(h.get("tensorboard", True), per_token), store=store)
            m = zdistill.distill(student, teacher, tokens, run)
            m.update(mfu.utilisation(cost(m["steps"], int(h["batch_size"])), m["seconds"],
                                     self.device))
        with self.building() as tmp:
            student.save_pretrained(tmp / "model")
            tok.save_pretrained(tmp / "model")
            self.keep_work(tmp, (LOSS_LOG, FINAL_STATE))
            write_json(tmp / "metrics.json", {**m, **extra, "peak_rss_mib": rss.mib, "peak_rss_exact": rss.exact})
        self.drop_work()
        self.log(f"{m['steps']} steps in {m['seconds']:.1f} s; final loss {m['final_loss']:.4f}")


def interior_pairs(block_metrics) -> list[tuple[int, int]]:
    """The assembled student's interior boundaries as ``(student_layer, teacher_layer)``: where
    block ``i >= 1`` starts in the student (the sum of earlier blocks' kept layers) and in the
    teacher (its ``start``), from the blocks' ``metrics.json`` records in block order."""
    pairs, offset = [], 0
    for prev, m in zip(block_metrics, block_metrics[1:]):
        offset += len(prev["kept"])
        pairs.append((offset, int(m["start"])))
    return pairs


class Heal(_DistillTask):
    """Healing: a short end-to-end logit-KD stage (KL teacher→student at ``heal.temperature``) of
    the assembled student against the teacher, ``heal.steps`` steps on the training split, plus
    with ``heal.hidden_weight`` > 0 the per-token normalised squared error between the student's
    and the teacher's residual streams at every interior boundary (the values the boundary cache
    holds, computed by the teacher's forward pass that gives the logits). Writes a Hugging Face
    folder like :class:`~tasks.assemble.Assemble`. Resumable from ``<out_dir>.partial``."""

    # 2: heal.hidden_weight > 0 now adds the hidden-state term (before, it was hashed but had no effect)
    code_version = 2
    heal = luigi.DictParameter(visibility=HIDDEN, description="the experiment's heal section")

    def requires(self):
        req = {"assemble": self.shared(Assemble, boundary=self.boundary, blocks=self.blocks, study=self.study,
                                       device=self.device),
               "corpus": self.corpus_task(), **self.logit_requires()}
        if float(self.heal.get("hidden_weight") or 0) > 0:  # the blocks' records place the interior boundaries
            req["blocks"] = self.block_tasks()
        return req

    def own_config(self):
        return {"heal": heal_hashed(self.heal)}

    def label(self):
        k = int(self.heal.get("top_k") or 0)
        return f"healed-{int(self.heal['steps'])}" + (f"-top{k}-{self.heal['targets']}" if k else "")

    def settings(self):
        return dict(self.heal)

    def start_student(self, teacher):
        import torch
        from transformers import AutoModelForCausalLM

        path = self.requires()["assemble"].out_dir / "model"
        blocks = self.requires().get("blocks")
        pairs = interior_pairs([json.loads((t.out_dir / "metrics.json").read_text()) for t in blocks]) if blocks else []
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=True).to(self.device), pairs, (
            {"pairs": pairs} if pairs else {})
