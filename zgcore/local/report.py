"""Local-learning study report: the report dict (gap to end-to-end, per-boundary CE, activation
memory per execution mode), its Markdown (tables via :mod:`zgcore.markdown`) and the gap-vs-K plot.
"""
from __future__ import annotations

import json
import os
from typing import Any
from collections.abc import Mapping, Sequence

from zgcore.training.lr_search import choose_lr, edge_note  # noqa: F401 (choose_lr re-exported: the search's argmin)
from zgcore.evaluation.compare import DESCRIPTIVE
from zgcore.markdown import num, table
from .findings import (NOT_MEASURED, NOT_REPRODUCED, NOT_RESOLVED_STATUS, REPRODUCED, arm_name,  # noqa: F401 (re-exported)
                       compared_pairs, paper_findings)


def tokens_per_parameter(parameters: int | None, vocab_size: int | None, hidden_size: int, tokens: int) -> dict[str, Any]:
    """Training tokens per non-embedding parameter, as every local-learning report states it.

    Args:
        parameters: all parameters of the K=1 model (``sum(p.numel())``; aux heads not counted).
        vocab_size: the model's vocabulary (rows of the input embedding and of the untied LM head).
        hidden_size: the model width. tokens: training tokens per configuration.

    Returns:
        ``{"non_embedding_parameters": parameters - 2 x vocab_size x hidden_size, "tokens",
        "ratio"}`` (``None`` where a count is missing).
    """
    non_emb = None if parameters is None or vocab_size is None else int(parameters) - 2 * int(vocab_size) * int(hidden_size)
    return {"non_embedding_parameters": non_emb, "tokens": int(tokens), "ratio": None if not non_emb else int(tokens) / non_emb}


def planned_tokens_per_parameter(cfg: Mapping[str, Any], vocab_size: int = 1024) -> dict[str, Any]:
    """:func:`tokens_per_parameter` of a resolved study config before anything runs: the K=1
    model is built on PyTorch's ``meta`` device (shapes only, no memory) by the same
    :func:`~zgcore.local.model.build_local` the training uses, with ``vocab_size`` rows (the
    ratio does not depend on it: the embedding and head are subtracted) and ``train.token_budget``
    floored to whole batches (as :func:`~zgcore.local.config.steps_for` trains it)."""
    import torch

    from .config import expand_study, steps_for
    from .model import build_local

    run = next(c["run"] for c in expand_study(cfg) if c["K"] == 1)
    seq = int(cfg["corpus"]["seq_len"])
    with torch.device("meta"):
        lm = build_local(run, int(vocab_size), seq, "meta")
    tokens = steps_for(run["train"], seq) * int(run["train"]["batch_size"]) * seq
    return tokens_per_parameter(sum(p.numel() for p in lm.model.parameters()), vocab_size, int(run["model"]["hidden_size"]), tokens)


def _mtp_label(cell: Mapping[str, Any]) -> str:
    b = cell["run"]["local"]["mtp_boundaries"]
    return "off" if not b else f"{cell['mtp']} ({','.join(map(str, b))}; n={cell['run']['local']['mtp_n']})"


def study_report(name: str, tokenizer: str, seq_len: int, cells: list[Mapping[str, Any]],
                 results: list[Mapping[str, Any]], descriptive: bool = False, selection: str | None = None) -> dict[str, Any]:
    """Assemble the study report from its cells and each cell's ``{"train": metrics, "eval": eval}``
    (with a learning-rate sweep also ``"choice"``: the ``choice.json`` of its lr choice).

    Gap = held-out CE (nats/token) minus the K=1 end-to-end CE of the same study and seed (same
    model and token budget; with a sweep, each configuration at the lr its search chose; ``rows[i]``
    then also has ``tune_lrs``/``tune_ce`` (every lr searched, ascending, and its tuning CE; None =
    diverged) and ``lr_search`` (``at_edge``, ``converged``, ``rounds``, ``max_rounds``,
    ``diverged``: see :func:`zgcore.training.lr_search.summary`)). Cells may carry ``"seed"``
    (:func:`zgcore.local.expand_seeds`); ``configs`` aggregates each configuration over seeds
    (mean, std). With each result's ``"scores"`` (the test evaluation's ``val`` part of
    ``per_sequence_ce.json``), ``comparisons`` (:func:`compared_pairs`, pooled over seeds) and
    ``findings`` (:func:`paper_findings`) are computed from them. Memory: peak
    saved-activation bytes in both execution modes and their ratio (together / per-block).
    Tokens per parameter: training tokens per configuration over the model's non-embedding
    parameters (all parameters less the input embedding and the untied LM head, ``2 x V x d``;
    aux heads not counted). FLOPs: each row's training FLOPs
    (:func:`zgcore.local.flops.run_flops`, counted with the run's own vocabulary), each config's
    ``flops`` too. ``descriptive``: a plumbing check (smoke preset): every comparison
    :func:`zgcore.evaluation.compare.descriptive`, no verdict. ``selection``: how each reported run's
    lr was chosen (said in the report). ``seed_varies``: what a seed changes.

    Raises:
        RuntimeError: the configurations of one seed did not see the same tokens (budget matching
            broken; the FLOPs-matched arm reads further by design) or no K=1 cell.
    """
    from .seeds import SEED_VARIES
    from .flops import run_flops

    matched = [r for c, r in zip(cells, results) if not c.get("flops_matched")]
    for s in sorted({c.get("seed", 0) for c in cells}):
        rs = [r for c, r in zip(cells, results) if c.get("seed", 0) == s and not c.get("flops_matched")]
        if len({r["train"]["tokens_sha256"] for r in rs}) != 1 or len({r["train"]["tokens"] for r in rs}) != 1:
            raise RuntimeError(f"token-budget matching failed: the configurations of seed {s} saw different token streams")
    base = {c.get("seed", 0): r["eval"]["held_out_ce"] for c, r in zip(cells, results) if c["K"] == 1 and not c.get("flops_matched")}
    if not base:
        raise RuntimeError("the study has no K=1 (end-to-end) configuration to measure gaps against")
    if any(c.get("seed", 0) not in base for c in cells):
        raise RuntimeError("every seed of the study needs its K=1 (end-to-end) configuration")
    e2e = next(iter(base.values()))
    rows, flops_of = [], {}
    for c, r in zip(cells, results):
        mem = r["train"]["memory"]
        key = json.dumps({**c["run"], "train": {k: v for k, v in c["run"]["train"].items() if k not in ("seed", "data_seed")}},
                         sort_keys=True)
        if key not in flops_of:
            flops_of[key] = run_flops(c["run"], int(r["train"]["vocab_size"]), int(seq_len))
        rows.append({"K": c["K"], "aux": c["aux"], "mtp": c["mtp"], "mtp_label": _mtp_label(c), "seed": c.get("seed", 0),
                     "arm": arm_name(c),
                     "mtp_boundaries": c["run"]["local"]["mtp_boundaries"], "held_out_ce": r["eval"]["held_out_ce"],
                     "gap": r["eval"]["held_out_ce"] - base[c.get("seed", 0)], "boundary_ce": r["eval"]["boundary_ce"],
                     "mem_together_bytes": mem["together"]["saved_peak_bytes"],
                     "mem_per_block_bytes": mem["per_block"]["saved_peak_bytes"],
                     "mem_together_cuda_bytes": mem["together"]["cuda_peak_bytes"],
                     "mem_per_block_cuda_bytes": mem["per_block"]["cuda_peak_bytes"],
                     "memory_ratio": r["train"]["memory_ratio"], "train_seconds": r["train"]["seconds"],
                     "parameters": r["train"].get("parameters"), "aux_parameters": r["train"].get("aux_parameters"),
                     "tokens": r["train"]["tokens"], "flops": flops_of[key]["total"], "flops_per_step": flops_of[key]["per_step"],
                     "steps": r["train"]["steps"], "flops_matched": bool(c.get("flops_matched")),
                     "search_runs": (r["choice"].get("per_seed") or [{"seed": c.get("seed", 0), "lrs": r["choice"]["lrs"],
                                                                       "tune_ce": r["choice"]["tune_ce"],
                                                                       "best_lr": r["choice"]["best_lr"]}])
                     if "choice" in r else None,
                     "lr": c["run"]["train"]["lr"] if "choice" not in r else r["choice"]["best_lr"],
                     "tune_lrs": r["choice"]["lrs"] if "choice" in r else None,
                     "tune_ce": r["choice"]["tune_ce"] if "choice" in r else None,
                     "lr_search": {k: r["choice"][k] for k in ("at_edge", "converged", "rounds", "max_rounds", "diverged")}
                     if "choice" in r else None, "dir": r.get("dir")})
    comparisons = []
    if all(r.get("scores") is not None for r in results):
        from zgcore.evaluation.compare import check_same_sequences, compare_arms

        check_same_sequences([r["scores"]["subset_sha256"] for r in results], "configurations")
        arms: dict[str, dict[int, Any]] = {}
        for c, r in zip(cells, results):
            arms.setdefault(arm_name(c), {})[c.get("seed", 0)] = r["scores"]["ce"]["model"]
        comparisons = compare_arms(compared_pairs(cells), arms, groups=results[0]["scores"].get("documents"))
        if descriptive:
            from zgcore.evaluation.compare import descriptive as describe_only

            describe_only(comparisons)
    configs = []
    for arm in dict.fromkeys(r["arm"] for r in rows):  # not `name`: that is the study's name, returned below
        rs = [r for r in rows if r["arm"] == arm]
        ces, gaps = [r["held_out_ce"] for r in rs], [r["gap"] for r in rs]
        configs.append({"arm": arm, "K": rs[0]["K"], "aux": rs[0]["aux"], "mtp": rs[0]["mtp"],
                        "seeds": [r["seed"] for r in rs], "held_out_ce": ces, "ce_mean": sum(ces) / len(ces),
                        "ce_std": _std(ces), "gap": sum(gaps) / len(gaps), "gap_std": _std(gaps),
                        "lr": [r["lr"] for r in rs], "flops": rs[0]["flops"], "tokens": rs[0]["tokens"],
                        "flops_matched": rs[0]["flops_matched"]})
    t0 = matched[0]["train"]
    model = cells[0]["run"]["model"]
    e2e_train = next(r["train"] for c, r in zip(cells, results) if c["K"] == 1 and not c.get("flops_matched"))
    total, vocab = e2e_train.get("parameters"), t0.get("vocab_size")
    tpp = tokens_per_parameter(total, vocab, int(model["hidden_size"]), t0["tokens"])
    ch = [r["choice"] for r in results if "choice" in r]
    sweep = None if not ch else {"grid": ch[0]["grid"], "max_rounds": ch[0]["max_rounds"],
                                 "tune_fraction": ch[0]["tune_fraction"],
                                 "tune_tokens": ch[0]["tune_tokens"], "tune_sequences": ch[0]["tune_sequences"],
                                 "tune_predicted_tokens": ch[0]["tune_predicted_tokens"]}
    return {"name": name, "tokenizer": tokenizer, "seq_len": int(seq_len), "model": model,
            "vocab_size": vocab, "model_parameters": total,
            "token_budget": {"tokens": t0["tokens"], "steps": t0["steps"], "batch_size": cells[0]["run"]["train"]["batch_size"],
                             "tokens_sha256": t0["tokens_sha256"], "matched": True},
            "tokens_per_parameter": tpp,
            "sweep": sweep, "val_tokens": results[0]["eval"]["val_tokens"], "e2e_ce": e2e, "rows": rows,
            "max_memory_ratio": max(r["memory_ratio"] for r in rows), "seeds": sorted(base),
            "configs": configs, "comparisons": comparisons, "findings": paper_findings(comparisons),
            "descriptive": bool(descriptive), "seed_varies": SEED_VARIES, "selection": selection}


def _std(xs: Sequence[float]) -> float | None:
    """Sample standard deviation, or None for a single value."""
    import statistics

    return statistics.stdev(xs) if len(xs) > 1 else None


def report_markdown(rep: Mapping[str, Any]) -> str:
    """Render :func:`study_report`'s dict as Markdown (CE in nats/token, memory in MiB); a figure
    that is missing or not finite is shown as such (:func:`zgcore.markdown.num`)."""
    mib = lambda b: num(None if b is None else b / 2 ** 20, ".1f")
    tb = rep["token_budget"]
    m = rep["model"]
    rows = [[r["K"] if not r.get("flops_matched") else "1 (FLOPs-matched)",
             r["aux"] + (f" [{r['arm'].split(' [')[1]}" if " [" in r.get("arm", "") else ""), r["mtp_label"], r.get("seed", 0),
             f"{r['lr']:g}", f"{r['tokens']:,}", num(r.get("flops"), ".3e"), num(r["held_out_ce"]), num(r["gap"], "+.4f"),
             " / ".join(num(c, ".3f") for c in r["boundary_ce"]), mib(r["mem_together_bytes"]),
             mib(r["mem_per_block_bytes"]), num(r["memory_ratio"], ".2f") + "x", num(r["train_seconds"], ".0f")]
            for r in rep["rows"]]
    banner = ([f"**{DESCRIPTIVE}**: a smoke preset (or a random model); the figures below check the plumbing, and no "
               "comparison has a verdict.", ""] if rep.get("descriptive") else [])
    lines = [f"# Greedy local learning study — {rep['name']}", "",
             f"Model: Llama-style, {m['n_layers']} layers, hidden {m['hidden_size']}, {m['n_heads']} heads, "
             f"vocab {rep['vocab_size']} ({m['vocab']}), {num(rep['model_parameters'], ',')} parameters (K=1; aux heads extra). "
             f"Tokenizer `{rep['tokenizer']}`, sequences of {rep['seq_len']} tokens.", "",
             f"**Token budget: {tb['tokens']:,} training tokens per configuration** ({tb['steps']} steps x "
             f"{tb['batch_size']} x {rep['seq_len']}); within a seed every configuration saw exactly the same token ids in "
             f"the same order (first seed's sha256 `{tb['tokens_sha256'][:16]}`)"
             + ("; the FLOPs-matched K=1 arm reads the same order further, for as many steps as the most expensive "
                "configuration's training FLOPs buy" if any(r.get("flops_matched") for r in rep["rows"]) else "")
             + f". Held-out CE over {rep['val_tokens']:,} predicted tokens.", "",
             f"**Seeds {rep['seeds']}**: a seed sets {rep.get('seed_varies') or 'the model initialisation'}.", "",
             "**Compute**: train FLOPs = each run's training FLOPs (forward and backward of every block, aux head, MTP "
             "head and LM head; counted per step with torch.utils.flop_counter on the meta device, times the steps). "
             "\"Matched\" means tokens for every configuration but the FLOPs-matched arm, which matches FLOPs.", "",
             *([f"**Learning rates**: {rep['selection']}", ""] if rep.get("selection") else []),
             table(["K", "aux head", "MTP (boundaries)", "seed", "lr", "tokens", "train FLOPs", "held-out CE", "gap to E2E",
                    "CE at boundaries 1..K",
                    "act. mem together (MiB)", "per-block (MiB)", "ratio", "train s"], rows),
             "", f"E2E (K=1) held-out CE: {num(rep['e2e_ce'])} nats/token. Gap = configuration CE minus E2E CE "
             "at the same token budget (positive = worse than end-to-end).", "",
             f"Activation memory: peak bytes autograd keeps for backward (saved tensors, parameters excluded), "
             f"measured on the first training batch in both execution modes. Largest together/per-block ratio: "
             f"**{num(rep['max_memory_ratio'], '.2f')}x** (the paper reports up to 2.2x).", "",
             "![gap vs K](gap_vs_k.png)", ""]
    return "\n".join(lines[:2] + banner + lines[2:4] + _tpp_lines(rep) + lines[4:] + _seeds_lines(rep) + _comparison_lines(rep)
                     + _sweep_lines(rep) + _findings_lines(rep))


def _seeds_lines(rep: Mapping[str, Any]) -> list[str]:
    cfgs = rep.get("configs") or []
    if len(rep.get("seeds") or []) < 2:
        return []
    rows = [[c["arm"], ", ".join(num(x) for x in c["held_out_ce"]), f"{num(c['ce_mean'])} ± {num(c['ce_std'])}",
             f"{num(c['gap'], '+.4f')} ± {num(c['gap_std'])}", ", ".join(f"{x:g}" for x in c["lr"]),
             f"{c.get('tokens', 0):,}", num(c.get("flops"), ".3e")] for c in cfgs]
    return [f"## Over seeds {rep['seeds']}", "",
            table(["configuration", "held-out CE per seed", "mean ± std", "gap to E2E (mean ± std)", "lr per seed",
                   "tokens per run", "train FLOPs per run"], rows), ""]


def _comparison_lines(rep: Mapping[str, Any]) -> list[str]:
    from zgcore.evaluation.compare import markdown as compare_md

    comps = rep.get("comparisons") or []
    return ["## Comparisons", "", compare_md(comps), ""] if comps else []


def _tpp_lines(rep: Mapping[str, Any]) -> list[str]:
    tpp = rep.get("tokens_per_parameter") or {}
    return [f"**Tokens per parameter: {num(tpp.get('ratio'), '.2f')}** — {tpp.get('tokens', 0):,} training tokens per "
            f"configuration over {num(tpp.get('non_embedding_parameters'), ',')} non-embedding parameters (all "
            "parameters less the input embedding and the LM head; aux heads not counted).", ""]


def _sweep_lines(rep: Mapping[str, Any]) -> list[str]:
    sw = rep.get("sweep")
    if not sw:
        return []

    def searched(sr):
        return ", ".join((f"**{lr:g}: {num(ce)}**" if lr == sr["best_lr"] else f"{lr:g}: {num(ce)}") if ce is not None
                         else f"{lr:g}: diverged" for lr, ce in zip(sr["lrs"], sr["tune_ce"]))

    def diverged(r):
        return "; ".join(f"{d['lr']:g} ({d.get('what') or 'non-finite'} at step {d.get('step')})"
                         for d in r["lr_search"]["diverged"]) or "none"

    rows = []
    for arm in dict.fromkeys(r["arm"] for r in rep["rows"]):
        rs = [r for r in rep["rows"] if r["arm"] == arm]
        runs = list({json.dumps(sr, sort_keys=True): sr for r in rs for sr in r["search_runs"] or []}.values())
        rows.append([arm, "; ".join(f"seed {sr['seed']}: {searched(sr)}" for sr in runs),
                     ", ".join(f"seed {r['seed']} at {r['lr']:g}" for r in rs),
                     edge_note({**rs[0]["lr_search"], "best_lr": rs[0]["lr"], "lrs": rs[0]["tune_lrs"]}), diverged(rs[0])])
    edge = [r for r in rep["rows"] if r["lr_search"]["at_edge"]]
    budget = ("the full budget of the final run (the chosen tuning run is the final run)" if sw["tune_fraction"] >= 1
              else f"{sw['tune_tokens']:,} tokens (tune_fraction {sw['tune_fraction']:g} of the final run's budget: "
              "a short-run choice, not shown here to equal the full-run choice)")
    return ["## Learning-rate search", "",
            f"Every configuration searched its own peak lr (zgcore.training.lr_search): the grid {', '.join(f'{x:g}' for x in sw['grid'])}, "
            f"then up to {sw['max_rounds'] - 1} more rounds that refine around the best lr (geometric midpoints) and extend "
            "past an edge when the best sits there, until the best is interior with neighbours at most 2x away. Each "
            f"candidate trained on {budget}, scored on {sw['tune_sequences']} tuning sequences held out of the training "
            f"split ({sw['tune_predicted_tokens']:,} predicted tokens; never trained on, never the test split). A run "
            "that diverged (non-finite loss or gradient norm) loses. The table above reports each configuration at "
            "its chosen lr, trained on the full budget and scored on the test split.", "",
            f"**Search runs and reported runs**: {rep.get('selection') or 'each seed searched its own lr'}", "",
            table(["configuration", "search runs: lr: tuning CE (chosen in bold)", "reported runs (test split)",
                   "where (first search)", "diverged (first search)"], rows), "",
            *([f"**{len(edge)} configuration(s) chose an lr at an edge of what was searched**: their optimum may lie "
               "beyond it (raise study.lr_rounds).", ""] if edge else [])]


def _findings_lines(rep: Mapping[str, Any]) -> list[str]:
    f = rep.get("findings") or {}
    rows = [[v["claim"], f"**{v['status']}**", v["detail"]] for v in f.values()]
    return ["## The paper's three findings", "",
            "Each judged on the comparisons above: reproduced only when every comparison it needs has the verdict it "
            "claims (a resolved, run-level verdict: at least 3 runs, Holm-adjusted p below 0.05, every run on its side); "
            "not reproduced when one is resolved the other way; otherwise not resolved, with its point estimate.", "",
            table(["finding", "here", "evidence (CE difference, nats/token, 95% CI)"], rows), ""]


def plot_gap_vs_k(rep: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Plot gap to end-to-end (nats/token, mean over seeds) against K, one line per aux head x MTP
    choice (K=1 at 0); PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    pts_of = rep.get("configs") or rep["rows"]
    variants = sorted({(r["aux"], r["mtp"]) for r in pts_of if r["K"] > 1})
    for aux, mtp in variants:
        pts = [(1, 0.0)] + sorted((r["K"], r["gap"]) for r in pts_of if r["K"] > 1 and r["aux"] == aux and r["mtp"] == mtp)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle="-" if aux == "transformer" else "--",
                label=f"{aux}, MTP {mtp}")
    ax.axhline(0, color="grey", linewidth=0.8)
    ks = sorted({r["K"] for r in rep["rows"]})
    ax.set_xticks(ks)
    ax.set_xlabel("K (gradient-isolated blocks)")
    ax.set_ylabel("held-out CE gap to end-to-end (nats/token)")
    ax.set_title(f"{rep['name']}: {rep['token_budget']['tokens']:,} tokens per configuration")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

