"""The MLP channels of a student layer: the teacher's width, which channels a narrower block keeps,
and the zero-padding that lets blocks of different widths share one Hugging Face config.

* Channel importance (Muralidharan et al. 2024, "Minitron", arXiv:2407.14679): a narrower block
  keeps the channels of largest mean |activation| (measured by :func:`zgcore.models.students.measure`),
  in their original order.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from zgcore.models.families import adapter_for


def mlp_width(config) -> int:
    """The teacher's MLP intermediate size (GPT-2: ``n_inner`` or 4 x hidden)."""
    ad = adapter_for(config)
    return int(getattr(config, ad.width_key, None) or 4 * config.hidden_size)


def mlp_parts(layer: nn.Module, ad) -> tuple[list[nn.Module], nn.Module]:
    """``(up projections, down projection)`` of a decoder layer's MLP (``ad``: its family's
    :class:`~zgcore.models.families.FamilyAdapter`); the down projection's input is the channel activation."""
    attr, ups, down = ad.mlp[:3]
    mlp = getattr(layer, attr)
    return [getattr(mlp, u) for u in ups], getattr(mlp, down)


def top_channels(magnitude: Sequence[float], width: int) -> torch.Tensor:
    """Indices (int64, ascending) of the ``width`` channels of largest mean |activation|."""
    m = torch.as_tensor(magnitude, dtype=torch.float64)
    return torch.sort(torch.topk(m, width, sorted=True).indices).values


def _select(layer_sd: dict[str, torch.Tensor], ad, idx: torch.Tensor, pad_to: int | None = None):
    """Keep channels ``idx`` of a layer's MLP weights (``pad_to``: instead scatter a narrow layer's
    channels into ``pad_to`` zero channels). ``layer_sd`` is keyed as in ``layer.state_dict()``."""
    attr, ups, down, fused, conv = ad.mlp
    out = dict(layer_sd)
    for k, v in layer_sd.items():
        parts = k.split(".")
        if len(parts) != 3 or parts[0] != attr or parts[1] not in (*ups, down):
            continue
        is_down = parts[1] == down
        if v.dim() == 1 and is_down:  # the down projection's bias is [hidden]
            continue
        # channel axis: Linear up [I, H] -> 0, Linear down [H, I] -> 1; Conv1D is transposed; bias [I] -> 0
        axis = 0 if v.dim() == 1 else (int(is_down) ^ int(conv))
        n_groups = 2 if fused and not is_down else 1
        groups = v.chunk(n_groups, dim=axis)
        if pad_to is None:
            new = [g.index_select(axis, idx.to(g.device)) for g in groups]
        else:
            new = []
            for g in groups:
                shape = list(g.shape)
                shape[axis] = pad_to
                z = g.new_zeros(shape)
                z.index_copy_(axis, idx.to(g.device), g)
                new.append(z)
        out[k] = torch.cat(new, dim=axis).contiguous()
    return out


def prune_layer(layer_sd: dict[str, torch.Tensor], config, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """A teacher layer's weights with only MLP channels ``idx`` kept (``len(idx)`` wide)."""
    return _select(layer_sd, adapter_for(config), idx)


def pad_layer(layer_sd: dict[str, torch.Tensor], config, width: int, to: int) -> dict[str, torch.Tensor]:
    """A ``width``-wide layer's weights widened to ``to`` channels with zero channels appended:
    a zero gate/up row (and bias) makes the channel's activation exactly 0, so the layer computes
    the same function."""
    return _select(layer_sd, adapter_for(config), torch.arange(width), pad_to=to)
