"""Held-out metrics: cross-entropy (nats/token), perplexity, and the share of a gap recovered."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm


@torch.no_grad()
def cross_entropy(model: torch.nn.Module, tokens: np.ndarray, batch_size: int = 8, desc: str = "eval") -> float:
    """Mean next-token cross-entropy of a causal LM over all predicted positions.

    Args:
        model: an HF causal LM. tokens: ``[n, seq_len]`` integer token ids.

    Returns:
        Cross-entropy in nats/token (float), averaged over ``n * (seq_len - 1)`` predictions.
    """
    device = next(model.parameters()).device
    model.eval()
    total, count = 0.0, 0
    for lo in tqdm(range(0, len(tokens), batch_size), desc=desc, unit="batch"):
        ids = torch.as_tensor(tokens[lo: lo + batch_size], dtype=torch.long, device=device)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum").item()
        count += ids[:, 1:].numel()
    return total / count


def perplexity(ce_nats: float) -> float:
    """``exp(cross-entropy)``; cross-entropy in nats/token."""
    return math.exp(ce_nats)


def gap_recovered(ce_untrained: float, ce_student: float, ce_teacher: float) -> float:
    """Share of the held-out CE gap between the untrained student and the teacher that training
    closed: ``(ce_untrained - ce_student) / (ce_untrained - ce_teacher)``; 1.0 = teacher-level.
    NaN when the gap is zero."""
    gap = ce_untrained - ce_teacher
    return (ce_untrained - ce_student) / gap if gap != 0 else float("nan")


def report_markdown(report: dict[str, Any]) -> str:
    """Render the main experiment report as Markdown."""
    ce = report["cross_entropy"]
    lines = [f"# ZeroGraph report — {report['name']}", "",
             f"Teacher: `{report['teacher']}`; boundaries {report['boundaries']}; "
             f"{report['val_tokens']} held-out tokens ({report['val_sequences']} sequences x {report['seq_len']}).", "",
             "| model | layers | held-out CE (nats/token) | perplexity |", "|---|---|---|---|"]
    for key, label in (("teacher", "teacher"), ("untrained", "untrained student"), ("student", "assembled student")):
        lines.append(f"| {label} | {report['layers'][key]} | {ce[key]:.4f} | {perplexity(ce[key]):.2f} |")
    lines += ["", f"Gap recovered by training: **{100 * report['gap_recovered']:.1f}%** "
              "of the held-out CE gap between the untrained student and the teacher.", "",
              "## Blocks", "", "| block | teacher layers | student layers (from teacher) | objective | steps | first loss | final loss | seconds |",
              "|---|---|---|---|---|---|---|---|"]
    for b in report["blocks"]:
        lines.append(f"| {b['block']} | [{b['start']}, {b['end']}) | {b['kept']} | {b['objective']} | {b['steps']} | "
                     f"{b['first_loss']:.4f} | {b['final_loss']:.4f} | {b['seconds']:.1f} |")
    lines += ["", f"Assembled model: `{report['model_dir']}` (loads with `AutoModelForCausalLM.from_pretrained`).", ""]
    if report.get("sample"):
        lines += ["## Sample", "", "```", report["sample"], "```", ""]
    return "\n".join(lines)
