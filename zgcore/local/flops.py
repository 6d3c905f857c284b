"""Compute said as compute: the floating-point operations a local-learning configuration spends, and
the end-to-end arm matched to the most expensive configuration in them.

A configuration's training FLOPs are counted on one forward of the configuration itself, not
from a formula of its shape: every ``nn.Linear`` call (layers, aux heads, MTP heads, LM heads, each
time it runs: an aux LM head shared by MTP offsets counts once per offset) costs
``2 x in x out`` FLOPs per token, every attention call ``4 x T x d_attn`` per token (scores and
their weighted sum over ``T`` positions; causal masking not discounted), counted with forward
hooks on one sequence and scaled by the batch size. A training step is three forwards (the
backward costs two; Kaplan et al. 2020, "Scaling laws for neural language models"; Hoffmann et
al. 2022's ``6 N`` per token); the embedding lookup and element-wise work (norms, activations,
softmax) are not counted. A run's total is a step's FLOPs times its steps.
"""
from __future__ import annotations

import copy
import math
from typing import Any
from collections.abc import Mapping, Sequence

from zgcore.checks import ConfigError
from .data import parse_vocab

FLOPS_MATCHED = "K=1 (e2e, FLOPs-matched)"


def flops_per_step(run: Mapping[str, Any], vocab_size: int, seq_len: int) -> int:
    """Training FLOPs of one optimizer step of configuration ``run`` (forward and backward of every
    block with its aux head, MTP heads and LM heads) on a batch of ``train.batch_size`` sequences of
    ``seq_len`` tokens, with a ``vocab_size``-row vocabulary (see the module's docstring). Returns
    an int (FLOPs)."""
    import torch
    from torch import nn

    from .model import build_local

    lm = build_local(run, int(vocab_size), int(seq_len), "cpu")
    T, fwd = int(seq_len), [0]

    def linear(m, _args, _out):
        fwd[0] += 2 * m.in_features * m.out_features * T

    def attention(m, _args, _out):
        heads = m.config.num_attention_heads
        fwd[0] += 4 * T * T * heads * m.head_dim

    hooks = [m.register_forward_hook(linear) for m in lm.modules() if isinstance(m, nn.Linear)]
    hooks += [m.register_forward_hook(attention) for m in lm.modules()
              if type(m).__name__.endswith("Attention") and hasattr(m, "head_dim")]
    try:
        with torch.no_grad():
            lm.block_losses(torch.zeros(1, T, dtype=torch.long))
    finally:
        for h in hooks:
            h.remove()
    return 3 * fwd[0] * int(run["train"]["batch_size"])


def run_flops(run: Mapping[str, Any], vocab_size: int, seq_len: int) -> dict[str, int]:
    """``{"per_step", "steps", "total"}``: a run's training FLOPs (:func:`flops_per_step` x steps)."""
    from .config import steps_for

    per, steps = flops_per_step(run, vocab_size, seq_len), steps_for(run["train"], seq_len)
    return {"per_step": per, "steps": steps, "total": per * steps}


def planned_vocab(cfg: Mapping[str, Any]) -> int:
    """The model's vocabulary size known before tokenising: ``N + 1`` for ``top:N``.

    Raises:
        ConfigError: another vocabulary (its size is known only once the corpus is tokenised)."""
    kind, n = parse_vocab(cfg["model"]["vocab"])
    if kind != "top":
        raise ConfigError(f"study.flops_matched needs model.vocab = \"top:N\" (the size of {cfg['model']['vocab']!r} is known "
                          "only after tokenising, and the matched arm's steps are fixed before)")
    return int(n) + 1


def flops_matched_cell(cfg: Mapping[str, Any], cells: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The end-to-end (K=1) cell that spends the FLOPs of the most expensive cell of ``cells``:
    the K=1 run with ``ceil(max_total / K1_per_step)`` steps (its token budget raised to match, so
    it sees more tokens: the same data order, read further). Named :data:`FLOPS_MATCHED`.

    Raises:
        ConfigError: no K=1 cell, or a vocabulary whose size is not known in advance (:func:`planned_vocab`)."""
    from .config import steps_for

    seq = int(cfg["corpus"]["seq_len"])
    vocab = planned_vocab(cfg)
    base = next((c for c in cells if int(c["K"]) == 1), None)
    if base is None:
        raise ConfigError("study.flops_matched needs a K=1 configuration")
    most = max(run_flops(c["run"], vocab, seq)["total"] for c in cells)
    per = flops_per_step(base["run"], vocab, seq)
    steps = max(steps_for(base["run"]["train"], seq), math.ceil(most / per))
    run = copy.deepcopy(dict(base["run"]))
    run["train"] = {**run["train"], "token_budget": steps * int(run["train"]["batch_size"]) * seq}
    return {"K": 1, "aux": "none", "mtp": "off", "flops_matched": True, "run": run}
