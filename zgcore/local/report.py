"""Local-learning study report: the report dict (gap to end-to-end, per-boundary CE, activation
memory per execution mode), its Markdown (tables via :mod:`zgcore.markdown`) and the gap-vs-K plot.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from zgcore.training.lr_search import choose_lr, edge_note  # noqa: F401 (choose_lr re-exported: the search's argmin)
from zgcore.markdown import num, table

NOT_MEASURED, REPRODUCED, NOT_REPRODUCED = "not measured", "reproduced", "not reproduced"
NOT_RESOLVED_STATUS = "not resolved"  # a comparison the finding needs has an interval containing 0


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


def arm_name(cell: Mapping[str, Any]) -> str:
    """A configuration's name in comparisons: ``"K=1 (e2e)"``, ``"K=4 transformer"``, ``"K=4 transformer MTP first"``."""
    if int(cell["K"]) == 1:
        return "K=1 (e2e)"
    mtp = cell.get("mtp", "off")
    return f"K={cell['K']} {cell['aux']}" + ("" if mtp in ("off", False, None) else f" MTP {mtp}")


def compared_pairs(cells: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """The pairs the study compares (names by :func:`arm_name`; CE of a minus CE of b): every K>1
    configuration vs K=1; per aux head without MTP, each larger K vs each smaller K>1; per K>1
    without MTP, the Transformer head vs the MLP head; per K>1 and aux head, MTP first vs off, all vs
    off, first vs all."""
    names = list(dict.fromkeys(arm_name(c) for c in cells))
    have = set(names)
    base = "K=1 (e2e)"
    pairs = [(n, base) for n in names if n != base and base in have]
    ks = sorted({int(c["K"]) for c in cells if int(c["K"]) > 1})
    auxs = list(dict.fromkeys(c["aux"] for c in cells if int(c["K"]) > 1))
    for aux in auxs:
        pairs += [(f"K={k2} {aux}", f"K={k1} {aux}") for i, k1 in enumerate(ks) for k2 in ks[i + 1:]]
    pairs += [(f"K={k} transformer", f"K={k} mlp") for k in ks]
    for k in ks:
        for aux in auxs:
            n = f"K={k} {aux}"
            pairs += [(f"{n} MTP first", n), (f"{n} MTP all", n), (f"{n} MTP first", f"{n} MTP all")]
        at_k = [n for n in names if n.startswith(f"K={k} ")]
        pairs += [(f, o) for f in at_k if f.endswith("MTP first") for o in at_k]  # is MTP first the best at this K?
    seen, out = set(), []
    for p in pairs:
        if p[0] in have and p[1] in have and p[0] != p[1] and p not in seen:
            seen.add(p)
            out.append(p)
    return out


def _status(verdicts: Sequence[str], want: str) -> str:
    """All verdicts ``want``: reproduced; any the opposite way: not reproduced; else not resolved."""
    from zgcore.evaluation.compare import NOT_RESOLVED

    if all(v == want for v in verdicts):
        return REPRODUCED
    if any(v not in (want, NOT_RESOLVED) for v in verdicts):
        return NOT_REPRODUCED
    return NOT_RESOLVED_STATUS


def paper_findings(comparisons: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The paper's three findings, judged on the study's comparisons (:mod:`zgcore.evaluation.compare`
    entries named by :func:`arm_name`), never on point estimates alone:

    * ``gap_grows_with_k``: for every aux head measured at K=2 and K=4 without MTP, K=4's CE is
      above K=2's (verdict ``"b better"`` for K=4 vs K=2);
    * ``transformer_beats_mlp``: at K=4 without MTP the Transformer aux head's CE is below the MLP's;
    * ``mtp_first_best``: a K=4 configuration with MTP at boundary 1 only beats every other K=4
      configuration measured (the best such one when both aux heads have it).

    A finding is ``"reproduced"`` when every comparison it needs has the verdict it claims, ``"not
    reproduced"`` when one has the opposite verdict, ``"not resolved"`` when an interval contains 0
    or the seeds disagree in sign (:func:`zgcore.evaluation.compare.compare`).

    Returns:
        ``{name: {"status": "reproduced" | "not reproduced" | "not resolved" | "not measured",
        "claim", "detail"}}``; ``detail`` is the comparisons' sentences.
    """
    from zgcore.evaluation.compare import A_BETTER, B_BETTER, sentence

    by = {(c["a"], c["b"]): c for c in comparisons}
    out: dict[str, dict[str, Any]] = {}
    grow = [c for (a, b), c in by.items() if a.startswith("K=4 ") and b.startswith("K=2 ") and "MTP" not in a + b
            and a.split(" ", 1)[1] == b.split(" ", 1)[1]]
    out["gap_grows_with_k"] = {"claim": "the gap to end-to-end grows from K=2 to K=4",
                               "status": _status([c["verdict"] for c in grow], B_BETTER) if grow else NOT_MEASURED,
                               "detail": "; ".join(map(sentence, grow)) or "needs the same aux head without MTP at K=2 and K=4"}
    tm = by.get(("K=4 transformer", "K=4 mlp"))
    out["transformer_beats_mlp"] = {"claim": "at K=4 the Transformer aux head beats the MLP aux head",
                                    "status": _status([tm["verdict"]], A_BETTER) if tm else NOT_MEASURED,
                                    "detail": sentence(tm) if tm else "needs K=4 with each aux head, MTP off"}
    k4 = sorted({n for pair in by for n in pair if n.startswith("K=4 ")})
    firsts = [n for n in k4 if n.endswith("MTP first")]
    # the best MTP-first configuration (lowest summed difference to the others), against every other K=4 one
    best = min(firsts, key=lambda n: sum(c["mean_diff"] for (a, _), c in by.items() if a == n), default=None)
    vs = [by[(best, o)] for o in k4 if best and o != best and (best, o) in by]
    verdicts = [c["verdict"] for c in vs]
    out["mtp_first_best"] = {"claim": "MTP at the first boundary only is the best K=4 configuration",
                             "status": _status(verdicts, A_BETTER) if vs else NOT_MEASURED,
                             "detail": "; ".join(map(sentence, vs)) or "needs K=4 with MTP at boundary 1 only and another K=4 configuration"}
    return out


def _mtp_label(cell: Mapping[str, Any]) -> str:
    b = cell["run"]["local"]["mtp_boundaries"]
    return "off" if not b else f"{cell['mtp']} ({','.join(map(str, b))}; n={cell['run']['local']['mtp_n']})"


def study_report(name: str, tokenizer: str, seq_len: int, cells: list[Mapping[str, Any]],
                 results: list[Mapping[str, Any]]) -> dict[str, Any]:
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
    aux heads not counted). ``findings``: :func:`paper_findings`.

    Raises:
        RuntimeError: the configurations did not see the same tokens (budget matching broken) or no K=1 cell.
    """
    shas = {r["train"]["tokens_sha256"] for r in results}
    toks = {r["train"]["tokens"] for r in results}
    if len(shas) != 1 or len(toks) != 1:
        raise RuntimeError(f"token-budget matching failed: configurations saw different token streams ({len(shas)} distinct)")
    base = {c.get("seed", 0): r["eval"]["held_out_ce"] for c, r in zip(cells, results) if c["K"] == 1}
    if not base:
        raise RuntimeError("the study has no K=1 (end-to-end) configuration to measure gaps against")
    if any(c.get("seed", 0) not in base for c in cells):
        raise RuntimeError("every seed of the study needs its K=1 (end-to-end) configuration")
    e2e = next(iter(base.values()))
    rows = []
    for c, r in zip(cells, results):
        mem = r["train"]["memory"]
        rows.append({"K": c["K"], "aux": c["aux"], "mtp": c["mtp"], "mtp_label": _mtp_label(c), "seed": c.get("seed", 0),
                     "arm": arm_name(c),
                     "mtp_boundaries": c["run"]["local"]["mtp_boundaries"], "held_out_ce": r["eval"]["held_out_ce"],
                     "gap": r["eval"]["held_out_ce"] - base[c.get("seed", 0)], "boundary_ce": r["eval"]["boundary_ce"],
                     "mem_together_bytes": mem["together"]["saved_peak_bytes"],
                     "mem_per_block_bytes": mem["per_block"]["saved_peak_bytes"],
                     "mem_together_cuda_bytes": mem["together"]["cuda_peak_bytes"],
                     "mem_per_block_cuda_bytes": mem["per_block"]["cuda_peak_bytes"],
                     "memory_ratio": r["train"]["memory_ratio"], "train_seconds": r["train"]["seconds"],
                     "parameters": r["train"].get("parameters"), "tokens": r["train"]["tokens"],
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
        comparisons = compare_arms(compared_pairs(cells), arms)
    configs = []
    for arm in dict.fromkeys(r["arm"] for r in rows):  # not `name`: that is the study's name, returned below
        rs = [r for r in rows if r["arm"] == arm]
        ces, gaps = [r["held_out_ce"] for r in rs], [r["gap"] for r in rs]
        configs.append({"arm": arm, "K": rs[0]["K"], "aux": rs[0]["aux"], "mtp": rs[0]["mtp"],
                        "seeds": [r["seed"] for r in rs], "held_out_ce": ces, "ce_mean": sum(ces) / len(ces),
                        "ce_std": _std(ces), "gap": sum(gaps) / len(gaps), "gap_std": _std(gaps),
                        "lr": [r["lr"] for r in rs]})
    t0 = results[0]["train"]
    model = cells[0]["run"]["model"]
    e2e_train = next(r["train"] for c, r in zip(cells, results) if c["K"] == 1)
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
            "configs": configs, "comparisons": comparisons, "findings": paper_findings(comparisons)}


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
    rows = [[r["K"], r["aux"], r["mtp_label"], r.get("seed", 0), f"{r['lr']:g}", num(r["held_out_ce"]), num(r["gap"], "+.4f"),
             " / ".join(num(c, ".3f") for c in r["boundary_ce"]), mib(r["mem_together_bytes"]),
             mib(r["mem_per_block_bytes"]), num(r["memory_ratio"], ".2f") + "x", num(r["train_seconds"], ".0f")]
            for r in rep["rows"]]
    lines = [f"# Greedy local learning study — {rep['name']}", "",
             f"Model: Llama-style, {m['n_layers']} layers, hidden {m['hidden_size']}, {m['n_heads']} heads, "
             f"vocab {rep['vocab_size']} ({m['vocab']}), {num(rep['model_parameters'], ',')} parameters (K=1; aux heads extra). "
             f"Tokenizer `{rep['tokenizer']}`, sequences of {rep['seq_len']} tokens.", "",
             f"**Token budget: {tb['tokens']:,} training tokens per configuration** ({tb['steps']} steps x "
             f"{tb['batch_size']} x {rep['seq_len']}); every configuration saw exactly the same token ids in the same "
             f"order (sha256 `{tb['tokens_sha256'][:16]}`). Held-out CE over {rep['val_tokens']:,} predicted tokens.", "",
             table(["K", "aux head", "MTP (boundaries)", "seed", "lr", "held-out CE", "gap to E2E", "CE at boundaries 1..K",
                    "act. mem together (MiB)", "per-block (MiB)", "ratio", "train s"], rows),
             "", f"E2E (K=1) held-out CE: {num(rep['e2e_ce'])} nats/token. Gap = configuration CE minus E2E CE "
             "at the same token budget (positive = worse than end-to-end).", "",
             f"Activation memory: peak bytes autograd keeps for backward (saved tensors, parameters excluded), "
             f"measured on the first training batch in both execution modes. Largest together/per-block ratio: "
             f"**{num(rep['max_memory_ratio'], '.2f')}x** (the paper reports up to 2.2x).", "",
             "![gap vs K](gap_vs_k.png)", ""]
    return "\n".join(lines[:4] + _tpp_lines(rep) + lines[4:] + _seeds_lines(rep) + _comparison_lines(rep)
                     + _sweep_lines(rep) + _findings_lines(rep))


def _seeds_lines(rep: Mapping[str, Any]) -> list[str]:
    cfgs = rep.get("configs") or []
    if len(rep.get("seeds") or []) < 2:
        return []
    rows = [[c["arm"], ", ".join(num(x) for x in c["held_out_ce"]), f"{num(c['ce_mean'])} ± {num(c['ce_std'])}",
             f"{num(c['gap'], '+.4f')} ± {num(c['gap_std'])}", ", ".join(f"{x:g}" for x in c["lr"])] for c in cfgs]
    return [f"## Over seeds {rep['seeds']}", "",
            table(["configuration", "held-out CE per seed", "mean ± std", "gap to E2E (mean ± std)", "lr per seed"], rows), ""]


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

    def searched(r):
        return ", ".join((f"**{lr:g}: {num(ce)}**" if lr == r["lr"] else f"{lr:g}: {num(ce)}") if ce is not None
                         else f"{lr:g}: diverged" for lr, ce in zip(r["tune_lrs"], r["tune_ce"]))

    def diverged(r):
        return "; ".join(f"{d['lr']:g} ({d.get('what') or 'non-finite'} at step {d.get('step')})"
                         for d in r["lr_search"]["diverged"]) or "none"

    rows = [[r["K"], r["aux"], r["mtp_label"], searched(r), f"{r['lr']:g}", edge_note({**r["lr_search"], "best_lr": r["lr"],
                                                                                       "lrs": r["tune_lrs"]}), diverged(r)]
            for r in rep["rows"]]
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
            table(["K", "aux head", "MTP", "lrs searched: tuning CE (chosen in bold)", "chosen lr", "where", "diverged"], rows), "",
            *([f"**{len(edge)} configuration(s) chose an lr at an edge of what was searched**: their optimum may lie "
               "beyond it (raise study.lr_rounds).", ""] if edge else [])]


def _findings_lines(rep: Mapping[str, Any]) -> list[str]:
    f = rep.get("findings") or {}
    rows = [[v["claim"], f"**{v['status']}**", v["detail"]] for v in f.values()]
    return ["## The paper's three findings", "",
            "Each judged on the comparisons above: reproduced only when every comparison it needs has the verdict it "
            "claims; not resolved when an interval contains 0 or the seeds disagree in sign.", "",
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

