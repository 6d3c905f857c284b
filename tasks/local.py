"""Greedy local learning graph (issue 6): PrepareTeacher (tokenizer only) → PrepareCorpus →
PretrainLocal(config) → EvaluateLocal(config) → LocalStudyReport.

Every PretrainLocal of a study reads the same token store with the same data seed, batch size
and budget, so all configurations see the same tokens in the same order.

With a learning-rate sweep (``study.lrs``, issue 14): for every configuration and lr a
PretrainLocal (on ``study.tune_fraction`` of the budget) and an EvaluateLocal on the tuning split
(training sequences held out of every configuration's training) → ChooseLocalLR (one per
configuration; ``choice.json`` names the lr of lowest tuning CE) → LocalStudyReport, which then
asks for each configuration's final PretrainLocal (full budget, chosen lr; the tuning run itself
when ``tune_fraction`` is 1) and its EvaluateLocal on the test split as dynamic dependencies.
"""
from __future__ import annotations

import json

import luigi

from zgcore import corpus, local as zlocal, metrics
from zgcore.atomic import write_json, write_text
from zgcore.loop import FINAL_STATE, LOSS_LOG

from .base import ZGTask
from .teacher import PrepareCorpus
from .work import Resumable


def _model_tokens(corpus_task: PrepareCorpus, setup) -> dict:
    """:func:`zgcore.local.model_splits` of the token store for one configuration: ``{"ids",
    "train", "tune", "val"}`` (the model's vocabulary as tokenizer ids; the splits in model ids)."""
    path = corpus_task.out_dir / "tokens.h5"
    train, val = corpus.read_tokens(path, "train"), corpus.read_tokens(path, "val")
    setup = json.loads(json.dumps(setup, default=dict))
    return zlocal.model_splits(train, val, setup, corpus.read_meta(path)["vocab_size"])


def _plain(obj):
    """A Luigi (frozen) Dict/ListParameter value as plain JSON types."""
    return json.loads(json.dumps(obj, default=lambda o: dict(o) if hasattr(o, "keys") else list(o)))


class _LocalTask(ZGTask):
    tokenizer = luigi.Parameter(description="teacher spec whose tokenizer is used (no teacher weights are used)")
    corpus = luigi.DictParameter()
    setup = luigi.DictParameter(description="one normalised configuration: {model, train, local}")
    checkpoint_every = luigi.IntParameter(default=50, significant=False,
                                          description="PretrainLocal: steps between checkpoints (not hashed)")

    def corpus_task(self) -> PrepareCorpus:
        return PrepareCorpus(teacher=self.tokenizer, corpus=self.corpus, outputs=self.outputs)

    def config_label(self) -> str:
        """``K<k>-<aux|e2e>[-mtp<boundaries>]-s<seed>``: the configuration, whatever its lr."""
        loc = self.setup["local"]
        mtp = "-mtp" + "_".join(map(str, loc["mtp_boundaries"])) if loc["mtp_boundaries"] else ""
        aux = f"-{loc['aux']}" if int(loc["K"]) > 1 else "-e2e"
        return f"K{loc['K']}{aux}{mtp}-s{self.setup['train']['seed']}"

    def label(self):
        lr = f"-lr{float(self.setup['train']['lr']):g}" if self.setup["train"].get("holdout_sequences") else ""
        return self.config_label() + lr


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
        data = _model_tokens(self.corpus_task(), setup)
        ids, train = data["ids"], data["train"]
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
    boundary's aux head; writes ``eval.json``. ``split="val"``: the test split (at most
    ``eval.max_sequences`` sequences); ``split="tune"``: the tuning sequences of a learning-rate
    sweep (all of them; the configuration must hold some out)."""

    code_deps = ("zgcore.local", "zgcore.metrics:cross_entropy")

    eval = luigi.DictParameter()
    split = luigi.ChoiceParameter(choices=["val", "tune"], default="val", description="val (test) | tune")

    def requires(self):
        return {"model": PretrainLocal(tokenizer=self.tokenizer, corpus=self.corpus, setup=self.setup,
                                       outputs=self.outputs, device=self.device, checkpoint_every=self.checkpoint_every),
                "corpus": self.corpus_task()}

    def own_config(self):
        return {"eval": self.eval} if self.split == "val" else {"eval": self.eval, "split": self.split}

    def label(self):
        return super().label() + ("-tune" if self.split == "tune" else "")

    def run(self):
        lm, ids = zlocal.load_local(self.requires()["model"].out_dir, self.device)
        val = _model_tokens(self.corpus_task(), self.setup)[self.split]
        if self.split == "tune" and not len(val):
            raise ValueError(f"{self.label()}: no tuning split (setup train.holdout_sequences is 0)")
        if self.split == "val" and int(self.eval["max_sequences"]):
            val = val[: int(self.eval["max_sequences"])]
        bsz = int(self.eval["batch_size"])
        ev = zlocal.evaluate_local(lm, val, bsz)
        ce = metrics.cross_entropy(lm.model, val, bsz, desc=f"CE {self.label()}")
        with self.building() as tmp:
            write_json(tmp / "eval.json", {**ev, "held_out_ce": ce, "val_sequences": int(len(val)),
                                           "val_tokens": int(len(val) * (val.shape[1] - 1)),
                                           **({"split": "tune"} if self.split == "tune" else {})})
        self.log(f"{self.split} CE {ce:.4f} nats/token; per boundary {[round(c, 4) for c in ev['boundary_ce']]}")


class ChooseLocalLR(_LocalTask):
    """One configuration's learning rate: trains it at every lr of the sweep (PretrainLocal on
    ``tune_fraction`` of the budget), scores each on the tuning split (EvaluateLocal,
    ``split="tune"``) and writes ``choice.json``: ``{"lrs" (ascending), "tune_ce" (nats/token, one
    per lr), "best_lr" (lowest tuning CE, ties to the smaller lr), "tune_tokens", "tune_fraction",
    "tune_sequences", "tune_predicted_tokens", "evaluations" (folders)}``. ``setup``: the
    configuration with its tuning split (``train.holdout_sequences``); its ``train.lr`` is unused."""

    uses_device = False  # reads the evaluations only
    code_deps = ("zgcore.local.report:choose_lr", "zgcore.local.config:sweep_run")

    lrs = luigi.ListParameter(description="peak learning rates, ascending")
    tune_fraction = luigi.FloatParameter(default=1.0, description="share of the token budget a tuning run sees")
    eval = luigi.DictParameter()

    def tune_setups(self) -> list:
        """The tuning configurations, one per lr (normalised runs)."""
        seq_len = int(self.corpus["seq_len"])
        return [zlocal.sweep_run(_plain(self.setup), lr, float(self.tune_fraction), seq_len) for lr in self.lrs]

    def requires(self):
        return [EvaluateLocal(tokenizer=self.tokenizer, corpus=self.corpus, setup=s, eval=self.eval, split="tune",
                              outputs=self.outputs, device=self.device, checkpoint_every=self.checkpoint_every)
                for s in self.tune_setups()]

    def own_config(self):
        return {"setup": self.setup, "lrs": [float(x) for x in self.lrs], "tune_fraction": float(self.tune_fraction)}

    def label(self):
        return self.config_label() + "-lrs"

    def run(self):
        evs = [json.loads((t.out_dir / "eval.json").read_text()) for t in self.requires()]
        lrs = [float(x) for x in self.lrs]
        ces = [e["held_out_ce"] for e in evs]
        best = zlocal.choose_lr(lrs, ces)
        with self.building() as tmp:
            write_json(tmp / "choice.json", {
                "lrs": lrs, "tune_ce": ces, "best_lr": best, "tune_fraction": float(self.tune_fraction),
                "tune_tokens": int(self.tune_setups()[0]["train"]["token_budget"]),
                "tune_sequences": evs[0]["val_sequences"], "tune_predicted_tokens": evs[0]["val_tokens"],
                "evaluations": [str(t.out_dir) for t in self.requires()]})
        self.log("tuning CE " + ", ".join(f"{lr:g}: {ce:.4f}" for lr, ce in zip(lrs, ces)) + f"; chosen lr {best:g}")


class LocalStudyReport(ZGTask):
    """The study report: held-out CE per configuration, gap to end-to-end at the same token
    budget, per-boundary CE, activation memory in both execution modes, tokens per non-embedding
    parameter, the paper's three findings; writes ``report.json``, ``report.md`` and ``gap_vs_k.png``.

    With a learning-rate sweep (``lrs``) it requires one :class:`ChooseLocalLR` per configuration
    and, once those have chosen, each configuration's final PretrainLocal and test EvaluateLocal as
    dynamic dependencies (``yield`` in :meth:`run`; :meth:`dynamic_upstream` lists them, so a
    rebuilt one makes this report stale like a static input)."""

    # 2: tokens per parameter, the paper's findings, the lr column and the learning-rate sweep
    code_version = 2
    uses_device = False  # reads the EvaluateLocal results only
    code_deps = ("zgcore.local", "zgcore.markdown")

    tokenizer = luigi.Parameter()
    corpus = luigi.DictParameter()
    cells = luigi.ListParameter(description="study cells: {K, aux, mtp, run}")
    eval = luigi.DictParameter()
    lrs = luigi.ListParameter(default=[], description="learning-rate sweep (ascending); [] = each run's train.lr")
    tune_fraction = luigi.FloatParameter(default=1.0, description="share of the token budget a tuning run sees")
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

    def _common(self) -> dict:
        return dict(tokenizer=self.tokenizer, corpus=self.corpus, outputs=self.outputs, device=self.device,
                    checkpoint_every=self.checkpoint_every)

    def _finals(self, runs: list) -> list:
        evals = [EvaluateLocal(setup=r, eval=self.eval, **self._common()) for r in runs]
        return evals + [e.requires()["model"] for e in evals]

    def requires(self):
        if self.lrs:
            return {"choices": [ChooseLocalLR(setup=r, lrs=list(self.lrs), tune_fraction=self.tune_fraction,
                                              eval=self.eval, **self._common()) for r in self._runs()]}
        # each model's metrics.json (tokens, memory, losses) is read here as well as its evaluation
        evals = self._finals(self._runs())
        return {"evaluations": evals[: len(evals) // 2], "models": evals[len(evals) // 2:]}

    def chosen_runs(self) -> list | None:
        """With a sweep: each configuration's final run (its chosen lr), in :meth:`_runs` order,
        or ``None`` while a choice is not made yet. Without a sweep: :meth:`_runs`."""
        if not self.lrs:
            return self._runs()
        out = []
        for task in self.requires()["choices"]:
            if not task.complete():
                return None
            best = json.loads((task.out_dir / "choice.json").read_text())["best_lr"]
            out.append(zlocal.sweep_run(_plain(task.setup), best))
        return out

    def dynamic_upstream(self) -> list:
        """The final tasks the report reads besides :meth:`requires` (sweep only; [] until chosen)."""
        runs = self.chosen_runs() if self.lrs else None
        return self._finals(runs) if runs else []

    def own_config(self):
        out = {"cells": [{k: c[k] for k in ("K", "aux", "mtp")} for c in self.cells]}
        if self.lrs:
            out["sweep"] = {"lrs": [float(x) for x in self.lrs], "tune_fraction": float(self.tune_fraction)}
        return out

    def label(self):
        return "study"

    def run(self):
        runs = self.chosen_runs()
        finals = self._finals(runs)
        if self.lrs:
            yield finals  # dynamic dependencies: the final runs are known only now
        n = len(runs)
        choices = {}
        if self.lrs:
            for task in self.requires()["choices"]:
                choices[json.dumps(_plain(task.setup), sort_keys=True)] = json.loads((task.out_dir / "choice.json").read_text())
        by_run = {}
        for base, t, model in zip(self._runs(), finals[:n], finals[n:]):
            key = json.dumps(_plain(base), sort_keys=True)
            pre = model.out_dir
            by_run[key] = {"train": json.loads((pre / "metrics.json").read_text()),
                           "eval": json.loads((t.out_dir / "eval.json").read_text()), "dir": str(pre),
                           **({"choice": choices[key]} if key in choices else {})}
        cells = _plain(list(self.cells))
        results = [by_run[json.dumps(c["run"], sort_keys=True)] for c in cells]
        rep = zlocal.study_report(self.name, self.tokenizer, int(self.corpus["seq_len"]), cells, results)
        with self.building() as tmp:
            write_json(tmp / "report.json", rep)
            write_text(tmp / "report.md", zlocal.report_markdown(rep))
            zlocal.plot_gap_vs_k(rep, tmp / "gap_vs_k.png")
        print(f"\nReport: {self.out_dir / 'report.md'}\n" + zlocal.report_markdown(rep), flush=True)
