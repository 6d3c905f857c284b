"""Attention transfer (LoLCATs' first stage; Zhang et al. 2024, arXiv:2410.10254): each converted
layer's token mixer learns to output what the teacher's attention outputs, on the same input.

The teacher's side is the block's own partition only: teacher layers ``[start, end)`` rebuilt from
their weights alone (a lazy layer source reads just those layers), run on the block's input
boundary ``x`` — the same bytes whether the boundary came from the store or from the teacher
online, so both give bitwise-identical targets. Student layer ``j`` (teacher layer ``kept[j]``) is
given the normalised stream that entered teacher layer ``kept[j]`` and the same rotary positions;
the loss is the mean over the block's layers of the MSE between its mixer's output and teacher
attention ``kept[j]``'s output.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class AttentionTargets:
    """The teacher partition's attention inputs and outputs at the kept layers.

    Args:
        partition: the teacher's layers ``[start, end)`` as a frozen
            :class:`~zgcore.models.adapters.StudentBlock` (softmax attention, teacher weights).
        start: the partition's first teacher layer. kept: the teacher layers the student's layers
            come from, in order (each in ``[start, end)``).
    """

    def __init__(self, partition: nn.Module, start: int, kept: Sequence[int]):
        self.partition = partition.requires_grad_(False).eval()
        self.rel = [int(k) - int(start) for k in kept]

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> list[tuple[torch.Tensor, tuple, torch.Tensor]]:
        """``x`` ``[B, T, hidden]`` float32 (boundary ``start``) -> per kept layer ``(normalised input
        [B, T, hidden], (cos, sin), attention output [B, T, hidden])``."""
        got: dict[int, list] = {}
        hooks = []
        for r in sorted(set(self.rel)):
            attn = self.partition.layers[r].self_attn

            def pre(_m, _args, kwargs, r=r):
                got[r] = [kwargs["hidden_states"], kwargs["position_embeddings"]]

            def post(_m, _args, output, r=r):
                got[r].append(output[0] if isinstance(output, tuple) else output)

            hooks += [attn.register_forward_pre_hook(pre, with_kwargs=True), attn.register_forward_hook(post)]
        try:
            self.partition(x)
        finally:
            for h in hooks:
                h.remove()
        return [tuple(got[r]) for r in self.rel]


def transfer_loss(block: nn.Module, targets: AttentionTargets, x: torch.Tensor) -> torch.Tensor:
    """Mean over ``block``'s layers of ``MSE(mixer_j(input_j), teacher attention_j(input_j))``
    (float32 scalar, squared units of the residual stream). ``block``: a converted
    :class:`~zgcore.models.adapters.StudentBlock` whose layer ``j`` comes from teacher layer
    ``targets.rel[j] + start``. ``x``: its input boundary ``[B, T, hidden]``."""
    losses = []
    for layer, (h, pe, y) in zip(block.layers, targets(x)):
        pred = layer.self_attn(hidden_states=h, position_embeddings=pe)[0]
        losses.append(F.mse_loss(pred.float(), y.float()))
    return torch.stack(losses).mean()
