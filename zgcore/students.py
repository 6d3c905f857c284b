"""Student shapes chosen from measurements on the teacher: which layers to keep (ShortGPT block
influence) and which MLP channels to keep when a block is narrower than the teacher (Minitron
activation magnitude), plus the zero-padding that lets blocks of different widths share one
Hugging Face config.

* Block influence (Men et al. 2024, "ShortGPT", arXiv:2403.03853): ``BI_i = 1 - mean_t cos(x_i, x_{i+1})``
  over the residual stream entering (``x_i``) and leaving (``x_{i+1}``) teacher layer ``i``; a
  layer that barely turns the stream matters least.
* Channel importance (Muralidharan et al. 2024, "Minitron", arXiv:2407.14679): the mean absolute
  activation of each MLP intermediate channel (the input of the down projection) over a sample;
  a narrower block keeps the largest channels, in their original order.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from .families import adapter_for


def mlp_width(config) -> int:
    """The teacher's MLP intermediate size (GPT-2: ``n_inner`` or 4 x hidden)."""
    ad = adapter_for(config)
    return int(getattr(config, ad.width_key, None) or 4 * config.hidden_size)


def _mlp_parts(layer: nn.Module, ad) -> tuple[list[nn.Module], nn.Module]:
    attr, ups, down = ad.mlp[:3]
    mlp = getattr(layer, attr)
    return [getattr(mlp, u) for u in ups], getattr(mlp, down)


@torch.no_grad()
def measure(teacher: nn.Module, tokens: np.ndarray, batch_size: int = 8) -> dict[str, list]:
    """Block influence of every teacher layer and the mean |activation| of every MLP channel.

    Args:
        teacher: a causal LM of a supported family. tokens: ``[n, seq_len]`` int token ids.

    Returns:
        ``{"influence": [L floats], "channels": [L lists of I floats]}``, averaged over all
        ``n * seq_len`` token positions (float64 accumulation).
    """
    from .adapters import capture_boundaries

    ad = adapter_for(teacher)
    layers = ad.decoder_layers(teacher)
    n_layers, device = len(layers), next(teacher.parameters()).device
    cos_sum = torch.zeros(n_layers, dtype=torch.float64)
    chan_sum: list[torch.Tensor | None] = [None] * n_layers
    count = 0

    def hook(i):
        def pre(_m, args):
            a = args[0].detach().abs().double().sum(dim=(0, 1)).cpu()
            chan_sum[i] = a if chan_sum[i] is None else chan_sum[i] + a
        return pre

    handles = [_mlp_parts(layer, ad)[1].register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        for lo in range(0, len(tokens), batch_size):
            ids = torch.as_tensor(tokens[lo: lo + batch_size], dtype=torch.long, device=device)
            bd = capture_boundaries(teacher, ids, list(range(n_layers + 1)))
            for i in range(n_layers):
                cos_sum[i] += torch.nn.functional.cosine_similarity(bd[i], bd[i + 1], dim=-1).double().sum().cpu()
            count += ids.numel()
    finally:
        for h in handles:
            h.remove()
    return {"influence": (1 - cos_sum / count).tolist(), "channels": [(c / count).tolist() for c in chan_sum]}


def needs_measure(t: Mapping[str, Any]) -> bool:
    """Whether a block's student shape needs :func:`measure` on the teacher."""
    return t["keep"] == "importance" or t.get("intermediate_size") is not None


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
