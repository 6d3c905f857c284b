"""Local-learning study report: the report dict (gap to end-to-end, per-boundary CE, activation
memory per execution mode), its Markdown (tables via :mod:`zgcore.markdown`) and the gap-vs-K plot.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from ..markdown import num, table

def _mtp_label(cell: Mapping[str, Any]) -> str:
    b = cell["run"]["local"]["mtp_boundaries"]
    return "off" if not b else f"{cell['mtp']} ({','.join(map(str, b))}; n={cell['run']['local']['mtp_n']})"


def study_report(name: str, tokenizer: str, seq_len: int, cells: list[Mapping[str, Any]],
                 results: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Assemble the study report from its cells and each cell's ``{"train": metrics, "eval": eval}``.

    Gap = held-out CE (nats/token) minus the K=1 end-to-end CE of the same study (same model,
    seed and token budget). Memory: peak saved-activation bytes in both execution modes and their
    ratio (together / per-block).

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
                     "parameters": r["train"].get("parameters"), "dir": r.get("dir")})
    t0 = results[0]["train"]
    model = cells[0]["run"]["model"]
    return {"name": name, "tokenizer": tokenizer, "seq_len": int(seq_len), "model": model,
            "vocab_size": t0.get("vocab_size"), "model_parameters": base[0]["train"].get("parameters"),
            "token_budget": {"tokens": t0["tokens"], "steps": t0["steps"], "batch_size": cells[0]["run"]["train"]["batch_size"],
                             "tokens_sha256": t0["tokens_sha256"], "matched": True},
            "val_tokens": results[0]["eval"]["val_tokens"], "e2e_ce": e2e, "rows": rows,
            "max_memory_ratio": max(r["memory_ratio"] for r in rows)}


def report_markdown(rep: Mapping[str, Any]) -> str:
    """Render :func:`study_report`'s dict as Markdown (CE in nats/token, memory in MiB); a figure
    that is missing or not finite is shown as such (:func:`zgcore.markdown.num`)."""
    mib = lambda b: num(None if b is None else b / 2 ** 20, ".1f")
    tb = rep["token_budget"]
    m = rep["model"]
    rows = [[r["K"], r["aux"], r["mtp_label"], num(r["held_out_ce"]), num(r["gap"], "+.4f"),
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
             table(["K", "aux head", "MTP (boundaries)", "held-out CE", "gap to E2E", "CE at boundaries 1..K",
                    "act. mem together (MiB)", "per-block (MiB)", "ratio", "train s"], rows),
             "", f"E2E (K=1) held-out CE: {num(rep['e2e_ce'])} nats/token. Gap = configuration CE minus E2E CE "
             "at the same token budget (positive = worse than end-to-end).", "",
             f"Activation memory: peak bytes autograd keeps for backward (saved tensors, parameters excluded), "
             f"measured on the first training batch in both execution modes. Largest together/per-block ratio: "
             f"**{num(rep['max_memory_ratio'], '.2f')}x** (the paper reports up to 2.2x).", "",
             "![gap vs K](gap_vs_k.png)", ""]
    return "\n".join(lines)


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

