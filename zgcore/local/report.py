"""Local-learning study report: the report dict (gap to end-to-end, per-boundary CE, activation
memory per execution mode), its Markdown (tables via :mod:`zgcore.markdown`) and the gap-vs-K plot.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from ..lr_search import choose_lr, edge_note  # noqa: F401 (choose_lr re-exported: the search's argmin)
from ..markdown import num, table

NOT_MEASURED, REPRODUCED, NOT_REPRODUCED = "not measured", "reproduced", "not reproduced"


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


def _find(rows: Sequence[Mapping[str, Any]], k: int, aux: str | None = None, mtp: Sequence[int] | None = None):
    return [r for r in rows if r["K"] == k and (aux is None or r["aux"] == aux)
            and (mtp is None or list(r["mtp_boundaries"]) == list(mtp))]


def paper_findings(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The paper's three findings, judged on the study's rows (``K``, ``aux``,
    ``mtp_boundaries``, ``held_out_ce`` and ``gap`` in nats/token; see :func:`study_report`).

    * ``gap_grows_with_k``: for every aux head measured at K=2 and K=4 without MTP, the K=4 gap
      to end-to-end is larger than the K=2 gap;
    * ``transformer_beats_mlp``: at K=4 without MTP the Transformer aux head's CE is below the MLP's;
    * ``mtp_first_best``: the lowest-CE K=4 configuration has MTP at boundary 1 only (needs that
      configuration and at least one other at K=4).

    Returns:
        ``{name: {"status": "reproduced" | "not reproduced" | "not measured", "claim", "detail"}}``.
    """
    out: dict[str, dict[str, Any]] = {}
    pairs = [(_find(rows, 2, a, [])[0], _find(rows, 4, a, [])[0]) for a in sorted({r["aux"] for r in rows})
             if _find(rows, 2, a, []) and _find(rows, 4, a, [])]
    detail = "; ".join(f"{r2['aux']}: K=2 {r2['gap']:+.4f}, K=4 {r4['gap']:+.4f}" for r2, r4 in pairs)
    out["gap_grows_with_k"] = {
        "claim": "the gap to end-to-end grows from K=2 to K=4",
        "status": NOT_MEASURED if not pairs else REPRODUCED if all(r4["gap"] > r2["gap"] for r2, r4 in pairs) else NOT_REPRODUCED,
        "detail": detail or "needs the same aux head without MTP at K=2 and K=4"}
    tr, ml = _find(rows, 4, "transformer", []), _find(rows, 4, "mlp", [])
    out["transformer_beats_mlp"] = {
        "claim": "at K=4 the Transformer aux head beats the MLP aux head",
        "status": NOT_MEASURED if not (tr and ml) else REPRODUCED if tr[0]["held_out_ce"] < ml[0]["held_out_ce"] else NOT_REPRODUCED,
        "detail": (f"CE transformer {tr[0]['held_out_ce']:.4f}, mlp {ml[0]['held_out_ce']:.4f}" if tr and ml
                   else "needs K=4 with each aux head, MTP off")}
    k4 = _find(rows, 4)
    first = [r for r in k4 if list(r["mtp_boundaries"]) == [1]]
    best = min(k4, key=lambda r: r["held_out_ce"]) if k4 else None
    measured = bool(first) and len(k4) > 1
    out["mtp_first_best"] = {
        "claim": "MTP at the first boundary only is the best K=4 configuration",
        "status": NOT_MEASURED if not measured else REPRODUCED if list(best["mtp_boundaries"]) == [1] else NOT_REPRODUCED,
        "detail": (f"best K=4: {best['aux']}, MTP {best['mtp_label']} (CE {best['held_out_ce']:.4f}) of {len(k4)}"
                   if measured else "needs K=4 with MTP at boundary 1 only and another K=4 configuration")}
    return out

def _mtp_label(cell: Mapping[str, Any]) -> str:
    b = cell["run"]["local"]["mtp_boundaries"]
    return "off" if not b else f"{cell['mtp']} ({','.join(map(str, b))}; n={cell['run']['local']['mtp_n']})"


def study_report(name: str, tokenizer: str, seq_len: int, cells: list[Mapping[str, Any]],
                 results: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Assemble the study report from its cells and each cell's ``{"train": metrics, "eval": eval}``
    (with a learning-rate sweep also ``"choice"``: the ``choice.json`` of its lr choice).

    Gap = held-out CE (nats/token) minus the K=1 end-to-end CE of the same study (same model,
    seed and token budget; with a sweep, each configuration at the lr its search chose; ``rows[i]``
    then also has ``tune_lrs``/``tune_ce`` (every lr searched, ascending, and its tuning CE; None =
    diverged) and ``lr_search`` (``at_edge``, ``converged``, ``rounds``, ``max_rounds``,
    ``diverged``: see :func:`zgcore.lr_search.summary`)). Memory: peak
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
    base = [r for c, r in zip(cells, results) if c["K"] == 1]
    if not base:
        raise RuntimeError("the study has no K=1 (end-to-end) configuration to measure gaps against")
    e2e = base[0]["eval"]["held_out_ce"]
    rows = []
    for c, r in zip(cells, results):
        mem = r["train"]["memory"]
        rows.append({"K": c["K"], "aux": c["aux"], "mtp": c["mtp"], "mtp_label": _mtp_label(c),
                     "mtp_boundaries": c["run"]["local"]["mtp_boundaries"], "held_out_ce": r["eval"]["held_out_ce"],
                     "gap": r["eval"]["held_out_ce"] - e2e, "boundary_ce": r["eval"]["boundary_ce"],
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
    t0 = results[0]["train"]
    model = cells[0]["run"]["model"]
    total, vocab = base[0]["train"].get("parameters"), t0.get("vocab_size")
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
            "max_memory_ratio": max(r["memory_ratio"] for r in rows), "findings": paper_findings(rows)}


def report_markdown(rep: Mapping[str, Any]) -> str:
    """Render :func:`study_report`'s dict as Markdown (CE in nats/token, memory in MiB); a figure
    that is missing or not finite is shown as such (:func:`zgcore.markdown.num`)."""
    mib = lambda b: num(None if b is None else b / 2 ** 20, ".1f")
    tb = rep["token_budget"]
    m = rep["model"]
    rows = [[r["K"], r["aux"], r["mtp_label"], f"{r['lr']:g}", num(r["held_out_ce"]), num(r["gap"], "+.4f"),
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
             table(["K", "aux head", "MTP (boundaries)", "lr", "held-out CE", "gap to E2E", "CE at boundaries 1..K",
                    "act. mem together (MiB)", "per-block (MiB)", "ratio", "train s"], rows),
             "", f"E2E (K=1) held-out CE: {num(rep['e2e_ce'])} nats/token. Gap = configuration CE minus E2E CE "
             "at the same token budget (positive = worse than end-to-end).", "",
             f"Activation memory: peak bytes autograd keeps for backward (saved tensors, parameters excluded), "
             f"measured on the first training batch in both execution modes. Largest together/per-block ratio: "
             f"**{num(rep['max_memory_ratio'], '.2f')}x** (the paper reports up to 2.2x).", "",
             "![gap vs K](gap_vs_k.png)", ""]
    return "\n".join(lines[:4] + _tpp_lines(rep) + lines[4:] + _sweep_lines(rep) + _findings_lines(rep))


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
            f"Every configuration searched its own peak lr (zgcore.lr_search): the grid {', '.join(f'{x:g}' for x in sw['grid'])}, "
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
    return ["## The paper's three findings", "", table(["finding", "here", "figures (held-out CE / gap, nats/token)"], rows), ""]


def plot_gap_vs_k(rep: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Plot gap to end-to-end (nats/token) against K, one line per aux head x MTP choice (K=1 at 0); PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    variants = sorted({(r["aux"], r["mtp"]) for r in rep["rows"] if r["K"] > 1})
    for aux, mtp in variants:
        pts = [(1, 0.0)] + sorted((r["K"], r["gap"]) for r in rep["rows"] if r["K"] > 1 and r["aux"] == aux and r["mtp"] == mtp)
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

