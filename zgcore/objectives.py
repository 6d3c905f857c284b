"""Block objectives: what a student block is given and what it must output.

An objective is a function ``make_pair(x, y, ctx) -> (input, target)`` registered by name, where
``x`` is the teacher's boundary i and ``y`` its boundary i+1 (float32 ``[batch, seq, hidden]``) and
``ctx`` is an :class:`ObjectiveContext`. The block is trained to map ``input`` to ``target`` with
:func:`regression_loss`. Adding one::

    @register("my_objective")
    def my_objective(x, y, ctx):
        return x, y

Source: ZeroGraph (arXiv:2611.02200) — ``clean`` teacher-boundary regression composes; the
unanchored ``denoise`` objective wins locally and fails to compose.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass
class ObjectiveContext:
    """What an objective may use besides the two boundaries.

    Attributes:
        generator: a ``torch.Generator`` seeded from (block seed, step), so a resumed run draws
            the same noise as an uninterrupted one.
        noise: noise level, a multiple of each channel's RMS. in_scale: per-channel RMS of the
            input boundary, ``[2, hidden]`` float32 (row 0: position 0; row 1: the rest).
    """

    generator: torch.Generator
    noise: float
    in_scale: torch.Tensor


OBJECTIVES: dict[str, Callable[[torch.Tensor, torch.Tensor, ObjectiveContext], Pair]] = {}


def register(name: str):
    """Decorator: register ``make_pair`` under ``name``."""
    def deco(fn):
        OBJECTIVES[name] = fn
        return fn
    return deco


def per_position(scale: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Expand a ``[2, hidden]`` (position 0, positions >= 1) scale to ``[seq_len, hidden]``."""
    return torch.cat([scale[:1], scale[1:2].expand(seq_len - 1, -1)], 0)


def _noise_like(x: torch.Tensor, ctx: ObjectiveContext) -> torch.Tensor:
    eps = torch.randn(x.shape, generator=ctx.generator, dtype=x.dtype, device="cpu").to(x.device)
    return ctx.noise * eps * per_position(ctx.in_scale, x.shape[1]).to(x.device)


@register("clean")
def clean(x: torch.Tensor, y: torch.Tensor, ctx: ObjectiveContext) -> Pair:
    """Clean teacher-boundary regression: boundary i in, boundary i+1 as target."""
    return x, y


@register("noisy")
def noisy(x: torch.Tensor, y: torch.Tensor, ctx: ObjectiveContext) -> Pair:
    """Anchored regression with corrupted input: boundary i + per-channel-scaled Gaussian noise in,
    boundary i+1 as target."""
    return x + _noise_like(x, ctx), y


@register("denoise")
def denoise(x: torch.Tensor, y: torch.Tensor, ctx: ObjectiveContext) -> Pair:
    """Unanchored denoising: boundary i + noise in, clean boundary i as target. Nothing ties the
    block's output to the teacher's next boundary."""
    return x + _noise_like(x, ctx), x


def regression_loss(pred: torch.Tensor, target: torch.Tensor, norm: str, target_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error between residual streams, normalised against massive activations.

    Args:
        pred, target: float32 ``[batch, seq, hidden]``.
        norm: ``"none"`` — plain MSE (dominated by the attention-sink position and a few outlier
            channels, whose norms are ~100x the rest in Llama-family models);
            ``"token"`` — per-token squared error divided by the target token's squared norm;
            ``"channel"`` — each channel's error divided by that channel's RMS, taken separately
            at position 0 (the attention sink) and at positions >= 1 (``target_scale``, ``[2, hidden]``),
            so every channel and position counts on one scale. A prediction of zero scores ~1.
        target_scale: required for ``"channel"``.

    Returns:
        A scalar float32 tensor (dimensionless).

    Raises:
        ValueError: unknown ``norm`` or a missing ``target_scale``.
    """
    err = pred - target
    if norm == "none":
        return err.pow(2).mean()
    if norm == "token":
        return (err.pow(2).sum(-1) / target.pow(2).sum(-1).clamp_min(1e-12)).mean()
    if norm == "channel":
        if target_scale is None:
            raise ValueError("loss_norm='channel' needs the target boundary's per-channel scale")
        s = per_position(target_scale, pred.shape[1]).to(pred.device).clamp_min(1e-6)
        return (err / s).pow(2).mean()
    raise ValueError(f"unknown loss normalisation {norm!r}")
