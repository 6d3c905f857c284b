"""Held-out metrics: cross-entropy (nats/token), perplexity, and the share of a gap recovered."""
from __future__ import annotations

import math
from typing import Any, Callable

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
    return cross_entropies(lambda ids: [model(input_ids=ids, use_cache=False).logits], tokens, batch_size, device, desc)[0]


@torch.no_grad()
def cross_entropies(logits_of: Callable[[torch.Tensor], list[torch.Tensor]], tokens: np.ndarray, batch_size: int,
                    device: torch.device | str, desc: str = "eval") -> list[float]:
    """Mean next-token cross-entropy (nats/token) of each of several predictions of the same tokens
    (e.g. a model's output and its auxiliary heads), over all ``n * (seq_len - 1)`` predicted positions.

    Args:
        logits_of: maps ids ``[B, seq_len]`` int64 to a list of logits, each ``[B, seq_len, V]``
            (logits at ``t`` predict token ``t + 1``; any float dtype, scored in float32).
        tokens: ``[n, seq_len]`` integer token ids.

    Returns:
        One cross-entropy per entry of ``logits_of``'s list.
    """
    totals: list[float] = []
    count = 0
    for lo in tqdm(range(0, len(tokens), batch_size), desc=desc, unit="batch"):
        ids = torch.as_tensor(tokens[lo: lo + batch_size], dtype=torch.long, device=device)
        for j, lg in enumerate(logits_of(ids)):
            lg = lg[:, :-1].float()
            ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum").item()
            if j == len(totals):
                totals.append(0.0)
            totals[j] += ce
        count += ids[:, 1:].numel()
    return [t / count for t in totals]


@torch.no_grad()
def context_use(model: torch.nn.Module, tokens: np.ndarray, window: int = 16, batch_size: int = 64) -> dict[str, float]:
    """How much a causal LM uses context beyond its last ``window`` tokens.

    For every prediction in the second half of each sequence (targets at positions
    ``seq_len//2 .. seq_len-1``) compare the cross-entropy with full context against the
    cross-entropy when the model sees only the last ``window`` tokens (a separate forward pass
    over just those tokens, which start at position 0).

    Args:
        model: HF causal LM. tokens: ``[n, seq_len]`` integer ids. window: W, tokens of context
            in the restricted condition (``1 <= W <= seq_len // 2``).

    Returns:
        ``{"full": CE_full, "window": CE_W, "context_use": CE_W - CE_full}`` in nats/token.
        Positive context use means the model uses its context; a model blind to context scores 0.

    Raises:
        ValueError: ``window`` out of range. Source: ZeroGraph (arXiv:2611.02200), context-use gate.
    """
    n, seq_len = tokens.shape
    if not 1 <= window <= seq_len // 2:
        raise ValueError(f"context window W={window} must be in [1, seq_len // 2 = {seq_len // 2}]")
    device = next(model.parameters()).device
    model.eval()
    ids = torch.as_tensor(tokens, dtype=torch.long, device=device)
    first = seq_len // 2  # first target position
    full_sum = win_sum = 0.0
    count = 0
    for i in range(n):
        row = ids[i: i + 1]
        logits = model(input_ids=row, use_cache=False).logits[0, first - 1: seq_len - 1].float()
        full_sum += F.cross_entropy(logits, row[0, first:], reduction="sum").item()
        # windows ending at each context position t = first-1 .. seq_len-2, each W tokens long
        starts = torch.arange(first - window, seq_len - 1 - window + 1, device=device)
        win = torch.stack([row[0, s: s + window] for s in starts.tolist()])
        for lo in range(0, len(win), batch_size):
            chunk = win[lo: lo + batch_size]
            wl = model(input_ids=chunk, use_cache=False).logits[:, -1].float()
            tgt = row[0, first + lo: first + lo + len(chunk)]
            win_sum += F.cross_entropy(wl, tgt, reduction="sum").item()
        count += seq_len - first
    full, windowed = full_sum / count, win_sum / count
    return {"full": full, "window": windowed, "context_use": windowed - full}


def gates(report: dict[str, Any], gap_threshold: float = 0.8, context_threshold: float = 0.8) -> dict[str, Any]:
    """Pass/fail quality gates, each with its threshold and measured value.

    * ``quality``: the assembled student recovers at least ``gap_threshold`` of the held-out CE
      gap between the untrained student and the teacher.
    * ``context``: the student's context use is positive and at least ``context_threshold`` times
      the teacher's.

    ``report`` needs ``gap_recovered`` and ``context_use`` (``{"teacher": {"context_use": ..}, "student": ..}``).
    Source: ZeroGraph (arXiv:2611.02200), quality and context-use gates.
    """
    g = report["gap_recovered"]
    out = {"quality": {"value": g, "threshold": gap_threshold, "passed": bool(g >= gap_threshold)}}
    cu = report.get("context_use")
    if cu:
        s, t = cu["student"]["context_use"], cu["teacher"]["context_use"]
        ratio = s / t if t else float("nan")
        out["context"] = {"value": ratio, "student": s, "teacher": t, "threshold": context_threshold,
                          "passed": bool(s > 0 and t > 0 and s >= context_threshold * t)}
    return out


def cache_economics(build_seconds: float, build_bytes: int, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Cache economics: what materialising the teacher's boundaries cost and when it pays off.

    Args:
        build_seconds: wall time of the cache build (s). build_bytes: its size on disk (bytes).
        jobs: one dict per TrainBlock with ``cached_seconds`` (wall time of the job with cached
            targets) and ``online_seconds`` (the same job with online targets), both in s.

    Returns:
        ``per_job`` (the jobs with their saving), ``experiment_cached_seconds`` /
        ``experiment_online_seconds`` (all jobs once; cached includes the build),
        ``break_even_reuses``: the smallest number N of full experiments (each running every job
        once) for which ``build + N * sum(cached) < N * sum(online)`` — None if online is never
        slower — and ``break_even_jobs``, the same count in single average jobs.

    Source: ZeroGraph (arXiv:2611.02200) reports a 618.31 s build with no break-even through 16 reuses.
    """
    cached = sum(j["cached_seconds"] for j in jobs)
    online = sum(j["online_seconds"] for j in jobs)
    saving = online - cached
    out = {"build_seconds": build_seconds, "build_bytes": build_bytes,
           "per_job": [{**j, "saving_seconds": j["online_seconds"] - j["cached_seconds"]} for j in jobs],
           "experiment_cached_seconds": build_seconds + cached, "experiment_online_seconds": online,
           "break_even_reuses": None, "break_even_jobs": None}
    if saving > 0:
        out["break_even_reuses"] = math.floor(build_seconds / saving) + 1
        per_job = saving / len(jobs)
        out["break_even_jobs"] = math.floor(build_seconds / per_job) + 1
    return out


@torch.no_grad()
def boundary_shift(teacher: torch.nn.Module, blocks: list, boundaries: list[int], tokens: np.ndarray,
                   scales: tuple[float, ...] = (0.05, 0.2, 0.5), seed: int = 0) -> dict[str, Any]:
    """How each trained block behaves off the teacher's trajectory, and how far the assembled
    student's residual stream drifts from the teacher's.

    Errors are the channel-normalised MSE of :func:`zgcore.objectives.regression_loss` against the
    teacher's boundary i+1, with the teacher's per-channel RMS measured on ``tokens``.

    Args:
        teacher: frozen causal LM. blocks: the K trained student blocks in order.
        boundaries: b0 .. bK. tokens: held-out ids ``[n, seq_len]``.
        scales: noise levels (multiples of each channel's RMS) added to teacher inputs.

    Returns:
        ``{"blocks": [{"block", "teacher_input", "student_input", "noisy_input": {scale: err}}],
        "drift": [{"boundary", "relative_error"}]}``; relative error is the channel-normalised
        MSE of the student chain's residual stream vs the teacher's at each boundary (0 at b0);
        ``"massive"`` measures the teacher's massive activations per boundary: the RMS norm of
        position 0 (the attention sink) over that of the other positions, and the largest channel
        RMS over the median channel RMS (positions >= 1).

    Source: ZeroGraph (arXiv:2611.02200), boundary-shift tests.
    """
    from .adapters import capture_boundaries
    from .boundary_store import channel_rms
    from .objectives import regression_loss

    device = next(teacher.parameters()).device
    ids = torch.as_tensor(tokens, dtype=torch.long, device=device)
    bd = capture_boundaries(teacher, ids, boundaries)
    scale = {b: channel_rms(h).to(h.device) for b, h in bd.items()}
    gen = torch.Generator().manual_seed(seed)
    rows, drift = [], [{"boundary": boundaries[0], "relative_error": 0.0}]
    chain = bd[boundaries[0]]
    for i, block in enumerate(blocks):
        block.eval()
        b_in, b_out = boundaries[i], boundaries[i + 1]
        err = lambda h: float(regression_loss(block(h), bd[b_out], "channel", scale[b_out]))
        noisy = {}
        for s in scales:
            eps = torch.randn(bd[b_in].shape, generator=gen).to(device)
            from .objectives import per_position

            noisy[str(s)] = err(bd[b_in] + s * eps * per_position(scale[b_in], bd[b_in].shape[1]).to(device))
        rows.append({"block": i, "teacher_input": err(bd[b_in]), "student_input": err(chain), "noisy_input": noisy})
        chain = block(chain)
        drift.append({"boundary": b_out, "relative_error": float(regression_loss(chain, bd[b_out], "channel", scale[b_out]))})
    massive = [{"boundary": b, "sink_norm_ratio": float(scale[b][0].norm() / scale[b][1].norm()),
                "top_channel_ratio": float(scale[b][1].max() / scale[b][1].median()),
                "top_channels": scale[b][1].topk(3).indices.tolist()} for b in boundaries]
    return {"blocks": rows, "drift": drift, "scales": list(scales), "massive": massive}


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
              "of the held-out CE gap between the untrained student and the teacher.", ""]
    cu = report.get("context_use")
    if cu:
        lines += [f"## Context use (W = {report['context_window']} tokens, {report['context_sequences']} sequences)", "",
                  "CE on the second half of each sequence with only the last W tokens visible, minus the same with full "
                  "context (nats/token; positive = the model uses its context).", "",
                  "| model | CE full context | CE last W tokens | context use |", "|---|---|---|---|"]
        for key, label in (("teacher", "teacher"), ("untrained", "untrained student"), ("student", "assembled student")):
            c = cu[key]
            lines.append(f"| {label} | {c['full']:.4f} | {c['window']:.4f} | {c['context_use']:+.4f} |")
        lines.append("")
    econ = report.get("economics")
    if econ:
        be = econ["break_even_reuses"]
        lines += ["## Cache economics", "",
                  f"Cache build: {econ.get('shards', 1)} shard(s), {econ['build_seconds']:.1f} s teacher time summed over "
                  f"shards, {econ.get('build_wall_seconds', econ['build_seconds']):.1f} s wall, {econ['build_bytes'] / 2**20:.1f} MiB "
                  f"({econ['build_seconds_per_sequence'] * 1000:.0f} ms/sequence through all {report['layers']['teacher']} teacher layers).", "",
                  "| block | cached job (s) | of which data (s) | compute (s) | online job (s) | online teacher (s) | saving (s) |",
                  "|---|---|---|---|---|---|---|"]
        for j in econ["per_job"]:
            lines.append(f"| {j['block']} | {j['cached_seconds']:.1f} | {j['data_seconds']:.1f} | {j['compute_seconds']:.1f} | "
                         f"{j['online_seconds']:.1f} | {j['online_teacher_seconds']:.1f} | {j['saving_seconds']:.1f} |")
        lines += ["", f"One experiment: cached {econ['experiment_cached_seconds']:.1f} s (build included) vs online "
                  f"{econ['experiment_online_seconds']:.1f} s. Break-even: "
                  + (f"**{be} experiment(s)** ({econ['break_even_jobs']} average block jobs)" if be else "never (online is not slower)")
                  + f". {econ['method']}", ""]
    shift = report.get("shift")
    if shift:
        lines += ["## Boundary shift", "",
                  "Each block's output error (channel-normalised MSE vs the teacher's next boundary) on the teacher's "
                  "inputs, on the inputs the assembled student actually feeds it, and on noisy teacher inputs.", "",
                  "| block | teacher input | student-chain input | " + " | ".join(f"noise {s}" for s in shift["scales"]) + " |",
                  "|---|---|---|" + "---|" * len(shift["scales"])]
        for r in shift["blocks"]:
            lines.append(f"| {r['block']} | {r['teacher_input']:.4f} | {r['student_input']:.4f} | "
                         + " | ".join(f"{r['noisy_input'][str(s)]:.4f}" for s in shift["scales"]) + " |")
        if shift.get("massive"):
            lines += ["", "Massive activations in the teacher's residual stream (why the loss is normalised per channel and "
                      "per position): " + "; ".join(f"b{m['boundary']}: sink/other norm {m['sink_norm_ratio']:.1f}x, "
                                                     f"top channel {m['top_channel_ratio']:.1f}x median"
                                                     for m in shift["massive"]) + "."]
        lines += ["", "Drift of the assembled student's residual stream from the teacher's: "
                  + ", ".join(f"b{d['boundary']}: {d['relative_error']:.4f}" for d in shift["drift"]), "",
                  "![drift](drift.png) ![loss curves](loss_curves.png)", ""]
    if report.get("gates"):
        lines += ["## Gates", "", "| gate | value | threshold | result |", "|---|---|---|---|"]
        for name, g in report["gates"].items():
            desc = ("share of CE gap recovered" if name == "quality" else "student / teacher context use")
            lines.append(f"| {name} ({desc}) | {g['value']:.3f} | {g['threshold']} | {'PASS' if g['passed'] else 'FAIL'} |")
        lines.append("")
    lines += [
              "## Blocks", "", "| block | teacher layers | student layers (from teacher) | objective | steps | first loss | final loss | seconds |",
              "|---|---|---|---|---|---|---|---|"]
    for b in report["blocks"]:
        lines.append(f"| {b['block']} | [{b['start']}, {b['end']}) | {b['kept']} | {b['objective']} | {b['steps']} | "
                     f"{b['first_loss']:.4f} | {b['final_loss']:.4f} | {b['seconds']:.1f} |")
    lines += ["", f"Assembled model: `{report['model_dir']}` (loads with `AutoModelForCausalLM.from_pretrained`).", ""]
    if report.get("sample"):
        lines += ["## Sample", "", "```", report["sample"], "```", ""]
    return "\n".join(lines)
