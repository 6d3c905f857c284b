"""Greedy local learning graph (issue 6): PrepareTeacher (tokenizer only) → PrepareCorpus →
PretrainLocal(config) → EvaluateLocal(config) → LocalStudyReport.

Every PretrainLocal of a study reads the same token store with the same data seed, batch size
and budget, so all configurations see the same tokens in the same order.
"""
from __future__ import annotations

import json

import luigi

from zgcore import corpus, local as zlocal, metrics
from zgcore.atomic import write_json, write_text
from zgcore.loop import FINAL_STATE, LOSS_LOG

from .base import ZGTask
from .pipeline import PrepareCorpus
from .work import Resumable


def _model_tokens(corpus_task: PrepareCorpus, vocab: str):
    """``(vocab_ids, train, val)``: the model's vocabulary (tokenizer ids) and both splits in model ids."""
    path = corpus_task.out_dir / "tokens.h5"
    train, val = corpus.read_tokens(path, "train"), corpus.read_tokens(path, "val")
    ids = zlocal.vocab_ids(train, val, vocab, corpus.read_meta(path)["vocab_size"])
    return ids, zlocal.remap(train, ids), zlocal.remap(val, ids)


class _LocalTask(ZGTask):
    tokenizer = luigi.Parameter(description="teacher spec whose tokenizer is used (no teacher weights are used)")
    corpus = luigi.DictParameter()
    setup = luigi.DictParameter(description="one normalised configuration: {model, train, local}")
    checkpoint_every = luigi.IntParameter(default=50, significant=False,
                                          description="PretrainLocal: steps between checkpoints (not hashed)")

    def corpus_task(self) -> PrepareCorpus:
        return PrepareCorpus(teacher=self.tokenizer, corpus=self.corpus, outputs=self.outputs)

    def label(self):
        loc = self.setup["local"]
        mtp = "-mtp" + "_".join(map(str, loc["mtp_boundaries"])) if loc["mtp_boundaries"] else ""
        aux = f"-{loc['aux']}" if int(loc["K"]) > 1 else "-e2e"
        return f"K{loc['K']}{aux}{mtp}-s{self.setup['train']['seed']}"


class PretrainLocal(Resumable, _LocalTask):
    """Pretrain one configuration from scratch with K gradient-isolated blocks for the token
    budget; writes ``model/`` (HF Llama), ``aux_heads.safetensors``, ``vocab_ids.npy``,
    ``local.json``, ``loss_log.csv``, ``train_state.pt`` (optimizer and RNG state) and
    ``metrics.json`` (tokens seen and their sha256, measured activation memory in both execution
    modes, losses, seconds). Checkpoints every ``checkpoint_every`` steps into
    ``<out_dir>.partial`` and resumes from there, bitwise-identical to an uninterrupted run; a
    non-finite loss or gradient norm fails it at once (:class:`zgcore.loop.NonFiniteError`)."""

    code_deps = ("zgcore.local", "zgcore.loop", "zgcore.corpus:read_tokens")

    def requires(self):
        return self.corpus_task()

    def own_config(self):
        return {"setup": self.setup}

    def run(self):
        import torch

        setup = json.loads(json.dumps(self.setup, default=dict))
        ids, train, _val = _model_tokens(self.corpus_task(), setup["model"]["vocab"])
        lm = zlocal.build_local(setup, len(ids), train.shape[1], self.device)
        n_params = sum(p.numel() for p in lm.model.parameters())
        n_aux = sum(p.numel() for p in lm.heads.parameters())
        self.log(f"{n_params:,} model + {n_aux:,} aux-head parameters, vocab {len(ids)}, blocks {lm.bounds}")

        def report(step: int, total: int, values: list) -> None:
            msg = f"step {step}/{total}, train CE per block " + " ".join(f"{v:.3f}" for v in values[: lm.k])
            self.progress(step, total, msg)
            self.log(msg)
        t = {**setup["train"], "log_every": 10, "checkpoint_every": int(self.checkpoint_every)}
        m = zlocal.train_local(lm, train, t, self.device, progress=report, work=self.work_dir, run_hash=self.uid,
                               name=f"{self.get_task_family()} {self.label()}")
        with self.building() as tmp:
            self.keep_work(tmp, (LOSS_LOG, FINAL_STATE))
            zlocal.save_local(tmp, lm, ids, setup)
            write_json(tmp / "metrics.json", {**m, "parameters": n_params, "aux_parameters": n_aux, "vocab_size": len(ids),
                                              "bounds": lm.bounds, "device": str(self.device), "torch": torch.__version__})
        self.drop_work()
        self.log(f"{m['steps']} steps, {m['tokens']:,} tokens in {m['seconds']:.0f} s; final CE per block "
                 f"{[round(x, 3) for x in m['final_loss']]}; activation memory ratio {m['memory_ratio']:.2f}x")


class EvaluateLocal(_LocalTask):
    """Held-out CE (nats/token) of one trained configuration: the model's own output, and every
    boundary's aux head; writes ``eval.json``."""

    code_deps = ("zgcore.local", "zgcore.metrics:cross_entropy")

    eval = luigi.DictParameter()

    def requires(self):
        return {"model": PretrainLocal(tokenizer=self.tokenizer, corpus=self.corpus, setup=self.setup,
                                       outputs=self.outputs, device=self.device, checkpoint_every=self.checkpoint_every),
                "corpus": self.corpus_task()}

    def own_config(self):
        return {"eval": self.eval}

    def run(self):
        lm, ids = zlocal.load_local(self.requires()["model"].out_dir, self.device)
        _, _, val = _model_tokens(self.corpus_task(), self.setup["model"]["vocab"])
        if int(self.eval["max_sequences"]):
            val = val[: int(self.eval["max_sequences"])]
        bsz = int(self.eval["batch_size"])
        ev = zlocal.evaluate_local(lm, val, bsz)
        ce = metrics.cross_entropy(lm.model, val, bsz, desc=f"CE {self.label()}")
        with self.building() as tmp:
            write_json(tmp / "eval.json", {**ev, "held_out_ce": ce, "val_sequences": int(len(val)),
                                           "val_tokens": int(len(val) * (val.shape[1] - 1))})
        self.log(f"held-out CE {ce:.4f} nats/token; per boundary {[round(c, 4) for c in ev['boundary_ce']]}")


class LocalStudyReport(ZGTask):
    """The study report: held-out CE per configuration, gap to end-to-end at the same token
    budget, per-boundary CE, activation memory in both execution modes; writes ``report.json``,
    ``report.md`` and ``gap_vs_k.png``."""

    uses_device = False  # reads the EvaluateLocal results only
    code_deps = ("zgcore.local", "zgcore.markdown")

    tokenizer = luigi.Parameter()
    corpus = luigi.DictParameter()
    cells = luigi.ListParameter(description="study cells: {K, aux, mtp, run}")
    eval = luigi.DictParameter()
    name = luigi.Parameter(default="local-study", significant=False)
    checkpoint_every = luigi.IntParameter(default=50, significant=False)

    def _runs(self) -> list:
        seen, out = set(), []
        for c in self.cells:
            key = json.dumps(c["run"], sort_keys=True, default=dict)
            if key not in seen:
                seen.add(key)
                out.append(c["run"])
        return out

    def requires(self):
        evals = [EvaluateLocal(tokenizer=self.tokenizer, corpus=self.corpus, setup=r, eval=self.eval,
                               outputs=self.outputs, device=self.device, checkpoint_every=self.checkpoint_every)
                 for r in self._runs()]
        # each model's metrics.json (tokens, memory, losses) is read here as well as its evaluation
        return {"evaluations": evals, "models": [e.requires()["model"] for e in evals]}

    def own_config(self):
        return {"cells": [{k: c[k] for k in ("K", "aux", "mtp")} for c in self.cells]}

    def label(self):
        return "study"

    def run(self):
        by_run = {}
        req = self.requires()
        for t, model in zip(req["evaluations"], req["models"]):
            key = json.dumps(t.setup, sort_keys=True, default=dict)
            pre = model.out_dir
            by_run[key] = {"train": json.loads((pre / "metrics.json").read_text()),
                           "eval": json.loads((t.out_dir / "eval.json").read_text()), "dir": str(pre)}
        cells = json.loads(json.dumps(list(self.cells), default=lambda o: dict(o) if hasattr(o, "keys") else list(o)))
        results = [by_run[json.dumps(c["run"], sort_keys=True)] for c in cells]
        rep = zlocal.study_report(self.name, self.tokenizer, int(self.corpus["seq_len"]), cells, results)
        with self.building() as tmp:
            write_json(tmp / "report.json", rep)
            write_text(tmp / "report.md", zlocal.report_markdown(rep))
            zlocal.plot_gap_vs_k(rep, tmp / "gap_vs_k.png")
        print(f"\nReport: {self.out_dir / 'report.md'}\n" + zlocal.report_markdown(rep), flush=True)
