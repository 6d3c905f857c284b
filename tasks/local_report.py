"""LocalStudyReport: the local-learning study's report over every configuration and seed (and,
with a learning-rate search, its choices: per seed, or on search seeds apart from the reported ones)."""
from __future__ import annotations

import json

import luigi

from zgcore import local as zlocal
from zgcore.atomic import write_json, write_text
from zgcore.evaluation import compare
from zgcore.evaluation.report import plumbing_check

from .base import ZGTask
from .local import ChooseLocalLR, EvaluateLocal, _plain, config_key


class LocalStudyReport(ZGTask):
    """The study report: held-out CE per configuration, gap to end-to-end at the same token
    budget, per-boundary CE, activation memory in both execution modes, tokens per non-embedding
    parameter, the paper's three findings; writes ``report.json``, ``report.md`` and ``gap_vs_k.png``.

    With a learning-rate sweep (``lrs``) it requires one :class:`ChooseLocalLR` per configuration
    and, once those have chosen, each configuration's final PretrainLocal and test EvaluateLocal as
    dynamic dependencies (``yield`` in :meth:`run`; :meth:`dynamic_upstream` lists them, so a
    rebuilt one makes this report stale like a static input)."""

    # 2: tokens per parameter, the paper's findings, the lr column and the learning-rate sweep
    # 3: the lr search (every lr searched per configuration, edges, diverged candidates)
    # 4: seeds, comparisons (paired bootstrap over test sequences, pooled over seeds), findings from their verdicts
    # 5: the seed-sign rule: a verdict with several seeds needs every seed's difference on its side ("why"); the report's name (an arm's name overwrote it)
    # 6: method comparisons over training runs (t interval, Holm-adjusted; fewer than 3 runs: not resolved), documents
    #    resampled, FLOPs per run, the FLOPs-matched arm, search seeds apart from reported seeds, plumbing checks descriptive
    # 7: the crossed run-level estimate (each variance component once), the document minimum, Holm-level intervals
    code_version = 7
    uses_device = False  # reads the EvaluateLocal results only

    tokenizer = luigi.Parameter()
    corpus = luigi.DictParameter()
    cells = luigi.ListParameter(description="study cells: {K, aux, mtp, run}")
    eval = luigi.DictParameter()
    lrs = luigi.ListParameter(default=[], description="learning-rate sweep (ascending); [] = each run's train.lr")
    tune_fraction = luigi.FloatParameter(default=1.0, description="share of the token budget a tuning run sees")
    lr_rounds = luigi.IntParameter(default=1, description="rounds of each configuration's lr search at most")
    search_seeds = luigi.ListParameter(default=[], description="seeds whose runs search the lr ([] = each seed its own)")
    name = luigi.Parameter(default="local-study", significant=False)
    checkpoint_every = luigi.IntParameter(default=50, significant=False)
    tensorboard = luigi.BoolParameter(default=True, significant=False, parsing=luigi.BoolParameter.EXPLICIT_PARSING)

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
                    checkpoint_every=self.checkpoint_every, tensorboard=self.tensorboard, study=self.name)

    def _finals(self, runs: list) -> list:
        evals = [EvaluateLocal(setup=r, eval=self.eval, **self._common()) for r in runs]
        return evals + [e.requires()["model"] for e in evals]

    def _choose(self, setup) -> ChooseLocalLR:
        return ChooseLocalLR(setup=setup, lrs=list(self.lrs), tune_fraction=self.tune_fraction, rounds=self.lr_rounds,
                             eval=self.eval, **self._common())

    def _searches(self) -> dict:
        """Configuration key (:func:`config_key`) -> the ChooseLocalLR tasks that choose its lr: one
        per search seed with ``search_seeds``, else the run's own (its seed searches for itself)."""
        out: dict = {}
        for r in self._runs():
            key = config_key(r)
            if self.search_seeds:
                out.setdefault(key, [self._choose(zlocal.seeded(_plain(r), s)) for s in self.search_seeds])
            else:
                out[json.dumps(_plain(r), sort_keys=True)] = [self._choose(r)]
        return out

    def _search_of(self, run) -> list:
        return self._searches()[config_key(run) if self.search_seeds else json.dumps(_plain(run), sort_keys=True)]

    def requires(self):
        if self.lrs:
            return {"choices": [t for ts in self._searches().values() for t in ts]}
        # each model's metrics.json (tokens, memory, losses) is read here as well as its evaluation
        evals = self._finals(self._runs())
        return {"evaluations": evals[: len(evals) // 2], "models": evals[len(evals) // 2:]}

    def chosen_runs(self) -> list | None:
        """With a sweep: each configuration's final run (its chosen lr), in :meth:`_runs` order,
        or ``None`` while a choice is not made yet. Without a sweep: :meth:`_runs`."""
        if not self.lrs:
            return self._runs()
        if not all(t.complete() for t in self.requires()["choices"]):
            return None
        return [zlocal.sweep_run(_plain(r), self._choice(r)["best_lr"]) for r in self._runs()]

    def _choice(self, run) -> dict:
        """The lr choice of ``run``'s configuration: its own search's ``choice.json``, or with
        search seeds the lr of lowest mean tuning CE over the search seeds (among the lrs every
        search seed tried; a diverged candidate counts as infinite), with ``per_seed`` searches."""
        ch = [json.loads((t.out_dir / "choice.json").read_text()) for t in self._search_of(run)]
        per = [{"seed": int(t.setup["train"]["seed"]), "lrs": c["lrs"], "tune_ce": c["tune_ce"], "best_lr": c["best_lr"]}
               for t, c in zip(self._search_of(run), ch)]
        if not self.search_seeds:
            return {**ch[0], "per_seed": per}
        common = sorted(set.intersection(*(set(c["lrs"]) for c in ch)))
        score = lambda lr: sum(float("inf") if c["tune_ce"][c["lrs"].index(lr)] is None else c["tune_ce"][c["lrs"].index(lr)]
                               for c in ch) / len(ch)
        return {**ch[0], "best_lr": min(common, key=score), "per_seed": per}

    def dynamic_upstream(self) -> list:
        """The final tasks the report reads besides :meth:`requires` (sweep only; [] until chosen)."""
        runs = self.chosen_runs() if self.lrs else None
        return self._finals(runs) if runs else []

    def own_config(self):
        out = {"cells": [{k: c[k] for k in ("K", "aux", "mtp", "seed") if k in c} for c in self.cells]}
        if self.lrs:
            out["sweep"] = {"lrs": [float(x) for x in self.lrs], "tune_fraction": float(self.tune_fraction),
                            "rounds": int(self.lr_rounds)}
            if self.search_seeds:
                out["sweep"]["search_seeds"] = [int(x) for x in self.search_seeds]
        return out

    def label(self):
        return "study"

    def selection(self) -> str:
        """How each reported run's lr was chosen, as the report states it."""
        if not self.lrs:
            fixed = len({float(c["run"]["train"]["lr"]) for c in self.cells}) > 1
            return ("each configuration trains at the lr its configuration names (study.configs lr; no search in this "
                    "study: reported runs are not selected on their own results)" if fixed else
                    "every run trains at train.lr (no search: reported runs are not selected on their own results)")
        if self.search_seeds:
            return (f"searched on seeds {list(self.search_seeds)} (their runs are listed apart and never reported); every "
                    "reported run is the chosen lr (lowest mean tuning CE over the search seeds) retrained on a seed that "
                    "took no part in the search")
        same = float(self.tune_fraction) >= 1
        return ("each seed searched its own lr and its reported run " + ("is its search's chosen candidate (the same run: its "
                "run-level luck helped choose it, a selection bias; set study.search_seeds to report fresh seeds)" if same
                else "retrains the chosen lr on the full budget with the same seed (set study.search_seeds to report "
                "fresh seeds)"))

    def run(self):
        runs = self.chosen_runs()
        finals = self._finals(runs)
        if self.lrs:
            yield finals  # dynamic dependencies: the final runs are known only now
        n = len(runs)
        choices = {json.dumps(_plain(r), sort_keys=True): self._choice(r) for r in self._runs()} if self.lrs else {}
        by_run = {}
        for base, t, model in zip(self._runs(), finals[:n], finals[n:]):
            key = json.dumps(_plain(base), sort_keys=True)
            pre = model.out_dir
            by_run[key] = {"train": json.loads((pre / "metrics.json").read_text()),
                           "eval": json.loads((t.out_dir / "eval.json").read_text()), "dir": str(pre),
                           "scores": compare.load_scores(t.out_dir / compare.SCORES)["val"],
                           **({"choice": choices[key]} if key in choices else {})}
        cells = _plain(list(self.cells))
        results = [by_run[json.dumps(c["run"], sort_keys=True)] for c in cells]
        rep = zlocal.study_report(self.name, self.tokenizer, int(self.corpus["seq_len"]), cells, results,
                                  descriptive=plumbing_check(self.tokenizer), selection=self.selection())
        with self.building() as tmp:
            write_json(tmp / "report.json", rep)
            write_text(tmp / "report.md", zlocal.report_markdown(rep))
            zlocal.plot_gap_vs_k(rep, tmp / "gap_vs_k.png")
