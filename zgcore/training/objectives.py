"""Block objectives: what a student block is given, what it must output, and what that depends on.

An objective is one registered :class:`Objective` subclass that carries everything about it:

* ``make_pair(x, y, ctx) -> (input, target)``, where ``x`` is the teacher's boundary i and ``y``
  its boundary i+1 (float32 ``[batch, seq, hidden]``) and ``ctx`` an :class:`ObjectiveContext`;
* ``anchored``: whether the target is the teacher's *next* boundary. The ``channel`` loss
  normalisation scales the error by the per-channel RMS of the boundary the target comes from:
  boundary i+1 for anchored objectives, boundary i for unanchored ones (see :meth:`Objective.scale_boundary`);
* ``reads``: the objective-specific train settings it uses (e.g. ``noise``). A setting that some
  objective reads but the chosen one does not cannot change a block's result, so it is left out of
  the block's hash (:func:`zgcore.config.experiment.effective_train`).

The block is trained to map ``input`` to ``target`` with :func:`regression_loss`. Adding one::

    @register
    class MyObjective(Objective):
        name = "my_objective"
        anchored = False          # the target is not boundary i+1
        reads = ("noise",)        # objective-specific settings it uses

        def make_pair(self, x, y, ctx):
            return x + noise_like(x, ctx), x

Also here: the local auxiliary terms added to any objective (:func:`aux_losses`, settings
``ce_weight``, ``mtp_weight``, ``mtp_n``): next-token CE and multi-token prediction of the block's
output read through the teacher's frozen final norm and LM head.

Source: ZeroGraph (arXiv:2611.02200) — ``clean`` teacher-boundary regression composes; the
unanchored ``denoise`` objective wins locally and fails to compose.
"""
from __future__ import annotations

from dataclasses import dataclass

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


class Objective:
    """Base of every objective; subclass it, set the class attributes, implement :meth:`make_pair`.

    Attributes:
        name: the value of ``train.objective`` that selects it.
        anchored: ``True`` when the target is the teacher's boundary i+1 (the loss scale then comes
            from boundary i+1), ``False`` for unanchored objectives (scale from boundary i).
        reads: objective-specific train settings it reads (keys of ``train``), e.g. ``("noise",)``.
    """

    name: str = ""
    anchored: bool = True
    reads: tuple[str, ...] = ()

    def make_pair(self, x: torch.Tensor, y: torch.Tensor, ctx: ObjectiveContext) -> Pair:
        """``(input, target)``, each float32 ``[batch, seq, hidden]``, from boundaries ``x`` (i) and ``y`` (i+1)."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, y: torch.Tensor, ctx: ObjectiveContext) -> Pair:
        return self.make_pair(x, y, ctx)

    def scale_boundary(self, b_in: int, b_out: int) -> int:
        """The boundary whose per-channel RMS scales the loss: ``b_out`` if anchored, else ``b_in``."""
        return b_out if self.anchored else b_in


OBJECTIVES: dict[str, Objective] = {}


def register(cls: type[Objective]) -> type[Objective]:
    """Class decorator: register one instance of ``cls`` under ``cls.name``.

    Raises:
        ValueError: an empty name or one already registered.
    """
    if not cls.name or cls.name in OBJECTIVES:
        raise ValueError(f"objective name {cls.name!r} is empty or already registered")
    OBJECTIVES[cls.name] = cls()
    return cls


def objective_settings() -> set[str]:
    """Every train setting some registered objective reads (the objective-specific settings)."""
    return {k for o in OBJECTIVES.values() for k in o.reads}


def per_position(scale: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Expand a ``[2, hidden]`` (position 0, positions >= 1) scale to ``[seq_len, hidden]``."""
    return torch.cat([scale[:1], scale[1:2].expand(seq_len - 1, -1)], 0)


def noise_like(x: torch.Tensor, ctx: ObjectiveContext) -> torch.Tensor:
    """Gaussian noise shaped like ``x`` (drawn on the CPU from ``ctx.generator``), ``ctx.noise``
    times the input boundary's per-channel RMS."""
    eps = torch.randn(x.shape, generator=ctx.generator, dtype=x.dtype, device="cpu").to(x.device)
    return ctx.noise * eps * per_position(ctx.in_scale, x.shape[1]).to(x.device)


@register
class Clean(Objective):
    """Clean teacher-boundary regression: boundary i in, boundary i+1 as target."""

    name = "clean"

    def make_pair(self, x, y, ctx):
        return x, y


@register
class Noisy(Objective):
    """Anchored regression with corrupted input: boundary i + per-channel-scaled Gaussian noise in,
    boundary i+1 as target."""

    name = "noisy"
    reads = ("noise",)

    def make_pair(self, x, y, ctx):
        return x + noise_like(x, ctx), y


@register
class Denoise(Objective):
    """Unanchored denoising: boundary i + noise in, clean boundary i as target. Nothing ties the
    block's output to the teacher's next boundary."""

    name = "denoise"
    anchored = False
    reads = ("noise",)

    def make_pair(self, x, y, ctx):
        return x + noise_like(x, ctx), x


@register
class AttentionTransfer(Objective):
    """Attention transfer, then clean regression (LoLCATs' first stage; Zhang et al. 2024,
    arXiv:2410.10254): for the first ``transfer_steps`` steps each converted layer's mixer matches
    the teacher attention's output on the same input (:func:`zgcore.training.transfer.transfer_loss`),
    then boundary i in, boundary i+1 as target, as ``clean``. Needs a mixer with weights to train."""

    name = "attention_transfer"
    reads = ("transfer_steps",)

    def make_pair(self, x, y, ctx):
        return x, y


AUX_SETTINGS = ("ce_weight", "mtp_weight", "mtp_n")  # train settings of the local auxiliary terms


def aux_active(t) -> dict[str, float]:
    """The local auxiliary terms that take effect under train settings ``t``: ``{"ce": w, "mtp": w}``
    holding only the terms whose weight is > 0 (absent keys count as 0)."""
    w = {"ce": float(t.get("ce_weight") or 0.0), "mtp": float(t.get("mtp_weight") or 0.0)}
    return {k: v for k, v in w.items() if v > 0}


def offset_ce(logits: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Mean cross-entropy (nats/token) of ``logits`` at position ``t`` predicting token ``t + k``.

    Args:
        logits: ``[batch, seq, vocab]`` (any float dtype; scored in float32).
        ids: ``[batch, seq]`` int64 token ids of the same sequences.
        k: offset >= 1, below ``seq``.

    Returns:
        A scalar float32 tensor over the ``batch * (seq - k)`` predictable positions.
    """
    lo = logits[:, : logits.shape[1] - k].float()
    return torch.nn.functional.cross_entropy(lo.reshape(-1, lo.shape[-1]), ids[:, k:].reshape(-1))


def aux_losses(logits: torch.Tensor, ids: torch.Tensor, active: dict[str, float], mtp_n: int) -> dict[str, torch.Tensor]:
    """The local auxiliary terms on a block's output, read through the teacher's frozen final norm
    and LM head (``logits`` = ``head_logits(teacher, block(x))``):

    * ``"ce"`` — next-token cross-entropy: logits at ``t`` predict token ``t + 1``;
    * ``"mtp"`` — multi-token prediction over the next ``mtp_n`` tokens: the mean over
      ``k = 1..mtp_n`` of the cross-entropy of the *same* logits at ``t`` predicting token
      ``t + k`` (no extra module: the head is frozen, so the term asks the block's output to carry
      information about the next ``mtp_n`` tokens; ``mtp_n = 1`` equals ``"ce"``). Offsets at or
      beyond ``seq`` are skipped.

    Args:
        logits: ``[batch, seq, vocab]``. ids: ``[batch, seq]`` int64.
        active: ``aux_active(t)`` — the terms to compute. mtp_n: >= 1.

    Returns:
        ``{name: scalar float32 tensor (nats/token)}`` for each active term (unweighted).
    """
    out = {}
    if "ce" in active:
        out["ce"] = offset_ce(logits, ids, 1)
    if "mtp" in active:
        ks = range(1, min(int(mtp_n), ids.shape[1] - 1) + 1)
        out["mtp"] = torch.stack([offset_ce(logits, ids, k) for k in ks]).mean()
    return out


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
