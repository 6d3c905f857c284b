"""Measurement on held-out data: cross-entropy (nats/token), context use, boundary shift, and the
teacher's forward time per batch. What the figures mean together (gap recovered, gates, economics,
markdown) is :mod:`zgcore.evaluation.report`'s."""
from __future__ import annotations

import time
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from zgcore.progress import progress_bar


@torch.no_grad()
def cross_entropy(model: torch.nn.Module, tokens: np.ndarray, batch_size: int = 8, desc: str = "eval") -> float:
    """Mean next-token cross-entropy of a causal LM over all predicted positions.

    Args:
        model: an HF causal LM. tokens: ``[n, seq_len]`` integer token ids.

    Returns:
        Cross-entropy in nats/token (float), averaged over ``n * (seq_len - 1)`` predictions.
    """
    return float(sequence_cross_entropy(model, tokens, batch_size, desc).mean())


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
        One cross-entropy per entry of ``logits_of``'s list (the mean of
        :func:`sequence_cross_entropies`: every sequence has the same ``seq_len - 1`` predictions).
    """
    return [float(x.mean()) for x in sequence_cross_entropies(logits_of, tokens, batch_size, device, desc)]


@torch.no_grad()
def sequence_cross_entropies(logits_of: Callable[[torch.Tensor], list[torch.Tensor]], tokens: np.ndarray,
                             batch_size: int, device: torch.device | str, desc: str = "eval") -> list[np.ndarray]:
    """Per-sequence mean next-token cross-entropy (nats/token) of each of several predictions of
    the same tokens: what a paired comparison of two models resamples (:mod:`zgcore.evaluation.compare`).

    Args:
        logits_of: as :func:`cross_entropies`. tokens: ``[n, seq_len]`` integer token ids.

    Returns:
        One float64 array ``[n]`` per entry of ``logits_of``'s list: entry ``i`` is the mean CE over
        the ``seq_len - 1`` predictions of sequence ``i`` (scored in float32, summed per row in float64).
    """
    out: list[list[np.ndarray]] = []
    bar = progress_bar(-(-len(tokens) // batch_size), desc, "batch")
    for lo in range(0, len(tokens), batch_size):
        ids = torch.as_tensor(tokens[lo: lo + batch_size], dtype=torch.long, device=device)
        # the last position predicts nothing (ignore_index): CE over every position's logits as they are,
        # with no copy of the [B, seq_len, V] logits (what slicing off the last position first cost: one more
        # logits-sized buffer, and 40% of this CE's time); each row's value is bitwise the same either way
        targets = F.pad(ids[:, 1:], (0, 1), value=-100).reshape(-1)
        for j, lg in enumerate(logits_of(ids)):
            ce = F.cross_entropy(lg.float().reshape(-1, lg.shape[-1]), targets, reduction="none")
            if j == len(out):
                out.append([])
            out[j].append(ce.reshape(ids.shape[0], -1)[:, :-1].double().mean(dim=1).cpu().numpy())
        bar.update(1)
    bar.close()
    return [np.concatenate(x) if x else np.zeros(0) for x in out]


def sequence_cross_entropy(model: torch.nn.Module, tokens: np.ndarray, batch_size: int = 8, desc: str = "eval") -> np.ndarray:
    """Per-sequence mean next-token cross-entropy (nats/token) of a causal LM: float64 ``[n]`` for
    ``tokens`` ``[n, seq_len]`` (see :func:`sequence_cross_entropies`); its mean is :func:`cross_entropy`."""
    device = next(model.parameters()).device
    model.eval()
    return sequence_cross_entropies(lambda ids: [model(input_ids=ids, use_cache=False).logits], tokens, batch_size,
                                    device, desc)[0]


def eval_subset(n: int, max_sequences: int, seed: int) -> np.ndarray:
    """The held-out rows an evaluation scores: all ``n`` rows when ``max_sequences`` is 0 or at
    least ``n``, else ``max_sequences`` rows drawn without replacement by
    ``numpy.random.default_rng((seed, 19))`` — a random sample of the split, not its first rows in
    corpus order, and the same for every arm and model evaluated with the same settings. Sorted
    int64 ``[m]`` (rows keep their split order); :func:`zgcore.evaluation.compare.subset_digest` names them.

    Raises:
        ValueError: ``n`` or ``max_sequences`` negative.
    """
    if n < 0 or max_sequences < 0:
        raise ValueError(f"test_subset needs n >= 0 and max_sequences >= 0, got {n}, {max_sequences}")
    if not max_sequences or max_sequences >= n:
        return np.arange(n, dtype=np.int64)
    return np.sort(np.random.default_rng((int(seed), 19)).choice(n, size=int(max_sequences), replace=False)).astype(np.int64)


def tune_subset(n: int, max_sequences: int, seed: int, who: str = "an lr search") -> np.ndarray:
    """The held-out rows an lr search scores its candidates on: every row of the split that is
    NOT in the test subset :func:`eval_subset` ``(n, max_sequences, seed)`` — so that no arm's
    learning rate is chosen on the sequences its CE is then reported on. Sorted int64
    ``[n - m]``.

    Raises:
        ValueError: no row is left (``max_sequences`` 0 or at least ``n``: every held-out sequence
            is a test sequence); the message names ``who`` and says to set ``eval.max_sequences``
            below ``n``.
    """
    test = eval_subset(n, max_sequences, seed)
    rows = np.setdiff1d(np.arange(n, dtype=np.int64), test)
    if not len(rows):
        raise ValueError(f"{who} scores its candidates on validation sequences outside the test subset, but "
                         f"eval.max_sequences={max_sequences} puts all {n} in it: set eval.max_sequences below {n} "
                         f"(e.g. {max(1, n // 2)}), or raise corpus.val_fraction")
    return rows


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
        for lo, chunk in _window_chunks(row, window, batch_size):
            wl = model(input_ids=chunk, use_cache=False).logits[:, -1].float()
            tgt = row[0, first + lo: first + lo + len(chunk)]
            win_sum += F.cross_entropy(wl, tgt, reduction="sum").item()
        count += seq_len - first
    full, windowed = full_sum / count, win_sum / count
    return {"full": full, "window": windowed, "context_use": windowed - full}


def _window_chunks(row: torch.Tensor, window: int, batch_size: int):
    """``(offset, ids [<= batch_size, window])`` of :func:`context_use`'s restricted condition for one
    row ``[1, seq_len]``: the windows ending at each context position ``seq_len//2 - 1 .. seq_len - 2``."""
    seq_len = row.shape[1]
    first = seq_len // 2
    starts = torch.arange(first - window, seq_len - 1 - window + 1, device=row.device)
    win = torch.stack([row[0, s: s + window] for s in starts.tolist()])
    return [(lo, win[lo: lo + batch_size]) for lo in range(0, len(win), batch_size)]


def scoring_batches(tokens: np.ndarray, batch_size: int, context_rows: int = 0, window: int = 16,
                    context_batch: int = 64) -> list[torch.Tensor]:
    """Every id batch (int64, CPU) that :func:`sequence_cross_entropy` (``batch_size``) and
    :func:`context_use` on the first ``context_rows`` rows (``window``, ``context_batch``) run a model
    on, in their order: what a streamed teacher runs layer by layer ahead of them."""
    ids = torch.as_tensor(tokens, dtype=torch.long)
    out = [ids[lo: lo + batch_size] for lo in range(0, len(ids), batch_size)]
    for i in range(int(context_rows)):
        out.append(ids[i: i + 1])
        out += [c for _, c in _window_chunks(ids[i: i + 1], window, context_batch)]
    return out


@torch.no_grad()
def boundary_shift(teacher: torch.nn.Module | None, blocks: list, boundaries: list[int], tokens: np.ndarray,
                   scales: tuple[float, ...] = (0.05, 0.2, 0.5), seed: int = 0,
                   teacher_boundaries: Mapping[int, torch.Tensor] | None = None) -> dict[str, Any]:
    """How each trained block behaves off the teacher's trajectory, and how far the assembled
    student's residual stream drifts from the teacher's.

    Errors are the channel-normalised MSE of :func:`zgcore.training.objectives.regression_loss` against the
    teacher's boundary i+1, with the teacher's per-channel RMS measured on ``tokens``.

    Args:
        teacher: frozen causal LM. blocks: the K trained student blocks in order.
        boundaries: b0 .. bK. tokens: held-out ids ``[n, seq_len]``.
        scales: noise levels (multiples of each channel's RMS) added to teacher inputs.
        teacher_boundaries: the teacher's boundaries of ``tokens`` ``{b: float32 [n, seq_len, hidden]}`` as
            :func:`~zgcore.models.adapters.capture_boundaries` gives them (e.g. read from the boundary
            store's validation shards); then ``teacher`` may be None and never runs.

    Returns:
        ``{"blocks": [{"block", "teacher_input", "student_input", "noisy_input": {scale: err}}],
        "drift": [{"boundary", "relative_error"}]}``; relative error is the channel-normalised
        MSE of the student chain's residual stream vs the teacher's at each boundary (0 at b0);
        ``"massive"`` measures the teacher's massive activations per boundary: the RMS norm of
        position 0 (the attention sink) over that of the other positions, and the largest channel
        RMS over the median channel RMS (positions >= 1).

    Source: ZeroGraph (arXiv:2611.02200), boundary-shift tests.
    """
    from zgcore.models.adapters import capture_boundaries
    from zgcore.data.boundary_store import channel_rms
    from zgcore.training.objectives import regression_loss

    if teacher_boundaries is not None:
        device = next(blocks[0].parameters()).device
        bd = {b: teacher_boundaries[b].to(device) for b in boundaries}
    else:
        device = next(teacher.parameters()).device
        bd = capture_boundaries(teacher, torch.as_tensor(tokens, dtype=torch.long, device=device), boundaries)
    scale = {b: channel_rms(h).to(h.device) for b, h in bd.items()}
    gen = torch.Generator().manual_seed(seed)
    rows, drift = [], [{"boundary": boundaries[0], "relative_error": 0.0}]
    chain = bd[boundaries[0]]
    for i, block in enumerate(blocks):
        block.eval()
        b_in, b_out = boundaries[i], boundaries[i + 1]
        err = lambda h, block=block, b_out=b_out: float(regression_loss(block(h), bd[b_out], "channel", scale[b_out]))
        noisy = {}
        for s in scales:
            eps = torch.randn(bd[b_in].shape, generator=gen).to(device)
            from zgcore.training.objectives import per_position

            noisy[str(s)] = err(bd[b_in] + s * eps * per_position(scale[b_in], bd[b_in].shape[1]).to(device))
        rows.append({"block": i, "teacher_input": err(bd[b_in]), "student_input": err(chain), "noisy_input": noisy})
        chain = block(chain)
        drift.append({"boundary": b_out, "relative_error": float(regression_loss(chain, bd[b_out], "channel", scale[b_out]))})
    massive = [{"boundary": b, "sink_norm_ratio": float(scale[b][0].norm() / scale[b][1].norm()),
                "top_channel_ratio": float(scale[b][1].max() / scale[b][1].median()),
                "top_channels": scale[b][1].topk(3).indices.tolist()} for b in boundaries]
    return {"blocks": rows, "drift": drift, "scales": list(scales), "massive": massive}


def held_out(models: Sequence[tuple[str, torch.nn.Module]], tokens: np.ndarray, eval_cfg: Mapping[str, Any],
             progress: Callable[[int, int, str], None] | None = None
             ) -> tuple[dict[str, float], dict[str, dict], dict[str, np.ndarray]]:
    """Held-out cross-entropy and context use of each model.

    Args:
        models: ``(key, causal LM)`` pairs. tokens: held-out ids ``[n, seq_len]``.
        eval_cfg: ``batch_size``, ``context_sequences`` (0 = no context use), ``context_window``.
        progress: called as ``progress(i, len(models), message)`` before each model.

    Returns:
        ``({key: CE nats/token}, {key: context_use dict}, {key: per-sequence CE float64 [n]})``
        (see :func:`context_use`, :func:`sequence_cross_entropy`; the CE is the per-sequence mean).
    """
    ce, cu, per_seq = {}, {}, {}
    n_ctx = min(int(eval_cfg["context_sequences"]), len(tokens))
    for i, (key, m) in enumerate(models):
        if progress:
            progress(i, len(models), f"held-out CE and context use: {key}")
        per_seq[key] = sequence_cross_entropy(m, tokens, int(eval_cfg["batch_size"]), desc=f"CE {key}")
        ce[key] = float(per_seq[key].mean())
        if n_ctx:
            cu[key] = context_use(m, tokens[:n_ctx], int(eval_cfg["context_window"]))
    return ce, cu, per_seq


@torch.no_grad()
def teacher_forward_seconds(teacher: torch.nn.Module, tokens: np.ndarray, start: int, end: int, batch_size: int,
                            repeats: int = 2) -> float:
    """Wall time (s) of the teacher's forward over one batch of ``batch_size`` sequences, capturing
    boundaries ``start`` and ``end`` (what an online-target training step pays per batch): one
    warm-up, then the mean of ``repeats`` timed calls. ``tokens``: ``[n, seq_len]`` ids, repeated
    to fill the batch when ``n < batch_size``."""
    from zgcore.models.adapters import capture_boundaries

    device = next(teacher.parameters()).device
    ids = torch.as_tensor(np.resize(tokens, (batch_size, tokens.shape[1])), dtype=torch.long, device=device)
    capture_boundaries(teacher, ids, [start, end])  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        capture_boundaries(teacher, ids, [start, end])
    return (time.perf_counter() - t0) / repeats
