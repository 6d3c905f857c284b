"""Greedy local learning graph: PrepareTeacher (tokenizer only) → PrepareCorpus →
PretrainLocal(config) → EvaluateLocal(config) → LocalStudyReport (:mod:`tasks.local_report`).

Every PretrainLocal of a study reads the same token store with the same data seed, batch size
and budget, so all configurations see the same tokens in the same order.

With a learning-rate search (``study.lrs``): for every configuration a
ChooseLocalLR that trains and scores one PretrainLocal + EvaluateLocal (tuning split: training
sequences held out of every configuration's training) per candidate lr — the grid ``study.lrs``
first, then up to ``study.lr_rounds - 1`` rounds of refinement/extension by
:mod:`zgcore.training.lr_search` as dynamic dependencies — and writes ``choice.json`` → LocalStudyReport,
which then asks for each configuration's final PretrainLocal (full budget, chosen lr; the tuning
run itself when ``study.tune_fraction`` is 1, the default) and its EvaluateLocal on the test split
as dynamic dependencies. A candidate whose training diverges is recorded (``diverged.json``) and loses.
"""
from __future__ import annotations

import json

import luigi

import numpy as np

from zgcore import local as zlocal
from zgcore.evaluation import compare, metrics
from zgcore.data import corpus
from zgcore.training import lr_search
from zgcore.atomic import write_json
from zgcore.local.pipeline import check_pipeline, train_pipeline
from zgcore.training.loop import FINAL_STATE, LOSS_LOG, NonFiniteError
from zgcore.threads import decoder_params

from . import search
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
    tensorboard = luigi.BoolParameter(default=True, significant=False, parsing=luigi.BoolParameter.EXPLICIT_PARSING,
                                      description="PretrainLocal: write TensorBoard events (not hashed)")
    study = luigi.Parameter(default="", significant=False, description="the study's name: its TensorBoard runs' folder")

    def model_params(self) -> int | None:
        """The from-scratch model's decoder (sizes the task's torch threads; see ZGTask.model_params)."""
        m = self.setup["model"]
        return decoder_params(m["n_layers"], m["hidden_size"], m["intermediate_size"])

    def corpus_task(self) -> PrepareCorpus:
        return PrepareCorpus(teacher=self.tokenizer, corpus=self.corpus, outputs=self.outputs)

    def config_label(self) -> str:
        """``K<k>-<aux|e2e>[-mtp<boundaries>][-pipe|-async]-s<seed>``: the configuration, whatever its lr."""
        loc = self.setup["local"]
        mtp = "-mtp" + "_".join(map(str, loc["mtp_boundaries"])) if loc["mtp_boundaries"] else ""
        aux = f"-{loc['aux']}" if int(loc["K"]) > 1 else "-e2e"
        t = self.setup["train"]
        pipe = ("-pipe" if t.get("pipeline_sync", True) else "-async") if t.get("execution") == "pipeline" else ""
        return f"K{loc['K']}{aux}{mtp}{pipe}-s{t['seed']}"

    def label(self):
        lr = f"-lr{float(self.setup['train']['lr']):g}" if self.setup["train"].get("holdout_sequences") else ""
        return self.config_label() + lr


def config_key(run) -> str:
    """A configuration's identity whatever its seed: the run without ``train.seed`` and ``train.data_seed`` (JSON)."""
    r = _plain(run)
    r["train"] = {k: v for k, v in r["train"].items() if k not in ("seed", "data_seed")}
    return json.dumps(r, sort_keys=True)


def is_candidate(setup) -> bool:
    """A run of a learning-rate search (it holds out a tuning split): its divergence is recorded, not raised."""
    return bool(setup["train"].get("holdout_sequences"))


class PretrainLocal(Resumable, _LocalTask):
    """Pretrain one configuration from scratch with K gradient-isolated blocks for the token
    budget; writes ``model/`` (HF Llama), ``aux_heads.safetensors``, ``vocab_ids.npy``,
    ``local.json``, ``loss_log.csv``, ``train_state.pt`` (optimizer and RNG state) and
    ``metrics.json`` (tokens seen and their sha256, measured activation memory in both execution
    modes, losses, seconds). Checkpoints every ``checkpoint_every`` steps into
    ``<out_dir>.partial`` and resumes from there, bitwise-identical to an uninterrupted run; a
    non-finite loss or gradient norm fails it at once (:class:`zgcore.training.loop.NonFiniteError`),
    except in a candidate of a learning-rate search (:func:`is_candidate`): there the output is
    only ``diverged.json`` (lr, step, which value) and the search goes on without it. With
    ``train.execution = "pipeline"`` it trains one process per block (:mod:`zgcore.local.pipeline`):
    ``loss_log.csv`` then also holds each block's staleness and idle seconds per step, and each
    stage's final state is ``train_state_stage<j>.pt``; a stage that dies fails it in one line."""

    def requires(self):
        return self.corpus_task()

    def own_config(self):
        return {"setup": self.setup}

    def run(self):
        import torch

        setup = json.loads(json.dumps(self.setup, default=dict))
        if setup["train"]["execution"] == "pipeline":  # devices and cores of this host, before anything is read
            check_pipeline(int(setup["local"]["K"]), self.device, setup["train"])
        data = _model_tokens(self.corpus_task(), setup)
        ids, train = data["ids"], data["train"]
        pipe = setup["train"]["execution"] == "pipeline"  # one process per block (zgcore.local.pipeline)
        lm = zlocal.build_local(setup, len(ids), train.shape[1], "cpu" if pipe else self.device)
        n_params = sum(p.numel() for p in lm.model.parameters())
        n_aux = sum(p.numel() for p in lm.heads.parameters())
        self.log(f"{n_params:,} model + {n_aux:,} aux-head parameters, vocab {len(ids)}, blocks {lm.bounds}")

        def report(step: int, total: int, values: list) -> None:
            msg = f"step {step}/{total}, train CE per block " + " ".join(f"{v:.3f}" for v in values[: lm.k])
            self.progress(step, total, msg)
            self.log(msg)
        t = {**setup["train"], "log_every": 10, "checkpoint_every": int(self.checkpoint_every)}
        kept = (LOSS_LOG, FINAL_STATE)
        try:
            if pipe:
                m = train_pipeline(lm, train, setup, t, self.device, work=self.work_dir, run_hash=self.uid, name=self.title())
                kept = tuple(m.pop("kept"))
            else:
                m = zlocal.train_local(lm, train, t, self.device, progress=report, work=self.work_dir, run_hash=self.uid,
                                       name=self.title(), callbacks=self.watchers(self.tensorboard))
        except NonFiniteError as e:
            if not is_candidate(setup):
                raise
            search.record_divergence(self, setup["train"]["lr"], e)  # a search candidate: it loses
            return
        with self.building() as tmp:
            self.keep_work(tmp, kept)
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
    sweep (all of them; the configuration must hold some out). A diverged tuning run gets
    ``{"held_out_ce": null, "diverged": {...}}``; a diverged run on the test split fails."""

    # 2: a seeded random test subset (eval.max_sequences, eval.subset_seed) and per-sequence CE (per_sequence_ce.json)
    # 3: each scored row's document id in per_sequence_ce.json (test split)
    code_version = 3

    eval = luigi.DictParameter()
    split = luigi.ChoiceParameter(choices=["val", "tune"], default="val", description="val (test) | tune")

    def requires(self):
        return {"model": PretrainLocal(tokenizer=self.tokenizer, corpus=self.corpus, setup=self.setup,
                                       outputs=self.outputs, device=self.device, checkpoint_every=self.checkpoint_every,
                                       tensorboard=self.tensorboard, study=self.study),
                "corpus": self.corpus_task()}

    def own_config(self):
        return {"eval": self.eval} if self.split == "val" else {"eval": self.eval, "split": self.split}

    def label(self):
        return super().label() + ("-tune" if self.split == "tune" else "")

    def run(self):
        div = search.diverged(self.requires()["model"])
        if div is not None:
            if self.split != "tune":
                raise RuntimeError(f"{self.label()}: the run to evaluate diverged at lr {div['lr']:g} ({div['what']} at step "
                                   f"{div['step']}); its tuning run did not: raise study.tune_fraction to 1")
            with self.building() as tmp:  # a diverged candidate has no CE: it loses the search
                write_json(tmp / "eval.json", {"held_out_ce": None, "diverged": div, "split": "tune"})
            self.log(f"lr {div['lr']:g} diverged ({div['what']} at step {div['step']}): no tuning CE")
            return
        lm, ids = zlocal.load_local(self.requires()["model"].out_dir, self.device)
        val = _model_tokens(self.corpus_task(), self.setup)[self.split]
        if self.split == "tune" and not len(val):
            raise ValueError(f"{self.label()}: no tuning split (setup train.holdout_sequences is 0)")
        rows = (metrics.eval_subset(len(val), int(self.eval["max_sequences"]), int(self.eval.get("subset_seed", 0)))
                if self.split == "val" else np.arange(len(val)))
        val = val[rows]
        bsz = int(self.eval["batch_size"])
        ev = zlocal.evaluate_local(lm, val, bsz)
        per_seq = metrics.sequence_cross_entropy(lm.model, val, bsz, desc=f"CE {self.label()}")
        ce = float(per_seq.mean())
        with self.building() as tmp:
            write_json(tmp / "eval.json", {**ev, "held_out_ce": ce, "val_sequences": int(len(val)),
                                           "val_tokens": int(len(val) * (val.shape[1] - 1)),
                                           "subset_sha256": compare.subset_digest(rows),
                                           **({"split": "tune"} if self.split == "tune" else {})})
            docs = corpus.read_documents(self.corpus_task().out_dir / "tokens.h5", "val") if self.split == "val" else None
            compare.save_scores(tmp / compare.SCORES, compare.scores_part({"model": per_seq}, rows,
                                                                          None if docs is None else docs[rows]))
        self.log(f"{self.split} CE {ce:.4f} nats/token; per boundary {[round(c, 4) for c in ev['boundary_ce']]}")


class ChooseLocalLR(_LocalTask):
    """One configuration's learning rate, by the search of :mod:`zgcore.training.lr_search`: round 1 trains
    it at every lr of ``lrs`` (one PretrainLocal each, on ``tune_fraction`` of the budget) and
    scores each on the tuning split (EvaluateLocal, ``split="tune"``); each further round (at most
    ``rounds`` in all) adds the candidates :func:`zgcore.training.lr_search.next_lrs` names — refining
    around the best, extending past an edge — as dynamic dependencies (``yield`` in :meth:`run`),
    until the best lr is interior with neighbours at most 2x away. A candidate that diverged loses
    (``diverged.json``); the task fails only when every candidate diverged.

    Writes ``choice.json``: ``{"grid", "lrs" (every lr searched, ascending), "tune_ce" (nats/token,
    one per lr; null = diverged), "best_lr" (lowest tuning CE, ties to the smaller lr), "at_edge",
    "converged", "rounds", "max_rounds", "diverged" ([{"lr", "step", "what", "value", "message"}]),
    "tune_tokens", "tune_fraction", "tune_sequences", "tune_predicted_tokens", "evaluations"
    (folders)}``. ``setup``: the configuration with its tuning split (``train.holdout_sequences``);
    its ``train.lr`` is unused."""

    # 2: the search (rounds beyond the grid as dynamic dependencies) and diverged candidates
    code_version = 2
    uses_device = False  # reads the evaluations only

    lrs = luigi.ListParameter(description="the first round's peak learning rates, ascending")
    rounds = luigi.IntParameter(default=1, description="rounds of the search at most (1 = lrs only)")
    tune_fraction = luigi.FloatParameter(default=1.0, description="share of the token budget a tuning run sees")
    eval = luigi.DictParameter()

    def candidate(self, lr: float) -> EvaluateLocal:
        """The tuning evaluation (and through it the tuning run) of this configuration at ``lr``."""
        setup = zlocal.sweep_run(_plain(self.setup), lr, float(self.tune_fraction), int(self.corpus["seq_len"]))
        return EvaluateLocal(tokenizer=self.tokenizer, corpus=self.corpus, setup=setup, eval=self.eval, split="tune",
                             outputs=self.outputs, device=self.device, checkpoint_every=self.checkpoint_every,
                             tensorboard=self.tensorboard, study=self.study)

    def tune_setups(self) -> list:
        """The first round's tuning configurations, one per lr (normalised runs)."""
        return [self.candidate(lr).setup for lr in self.lrs]

    def requires(self):
        return [self.candidate(lr) for lr in self.lrs]

    def _search(self):
        score = lambda t: (lambda e: {"score": e["held_out_ce"], "diverged": e.get("diverged"), "eval": e})(
            json.loads((t.out_dir / "eval.json").read_text()))
        return [float(x) for x in self.lrs], int(self.rounds), self.candidate, score

    def dynamic_upstream(self) -> list:
        """The candidates of rounds 2.. that exist (they are read like the static first round)."""
        return search.replay(*self._search())[2][len(self.lrs):]

    def own_config(self):
        return {"setup": self.setup, "lrs": [float(x) for x in self.lrs], "rounds": int(self.rounds),
                "tune_fraction": float(self.tune_fraction)}

    def label(self):
        return self.config_label() + "-lrs"

    def run(self):
        s, tasks = yield from search.run_search(*self._search(), who=self.config_label(), hint="lower study.lrs")
        first = next(r["eval"] for r in s["results"].values() if r["score"] is not None)
        with self.building() as tmp:
            write_json(tmp / "choice.json", {
                **{k: s[k] for k in ("grid", "lrs", "best_lr", "at_edge", "converged", "rounds", "max_rounds", "diverged")},
                "tune_ce": s["scores"], "tune_fraction": float(self.tune_fraction),
                "tune_tokens": int(self.tune_setups()[0]["train"]["token_budget"]),
                "tune_sequences": first["val_sequences"], "tune_predicted_tokens": first["val_tokens"],
                "evaluations": [str(t.out_dir) for t in tasks]})
        self.log("tuning CE " + ", ".join(f"{lr:g}: {'diverged' if ce is None else f'{ce:.4f}'}"
                                          for lr, ce in zip(s["lrs"], s["scores"]))
                 + f"; chosen lr {s['best_lr']:g} ({lr_search.edge_note(s)})")
