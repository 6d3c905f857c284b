"""Student shapes chosen from measurements on the teacher: the measurements that decide which
layers to keep (ShortGPT block influence) and which MLP channels to keep when a block is narrower
than the teacher (Minitron activation magnitude). Selecting and zero-padding the channels
themselves is :mod:`zgcore.models.channels`.

* Block influence (Men et al. 2024, "ShortGPT", arXiv:2403.03853): ``BI_i = 1 - mean_t cos(x_i, x_{i+1})``
  over the residual stream entering (``x_i``) and leaving (``x_{i+1}``) teacher layer ``i``; a
  layer that barely turns the stream matters least.
* Channel importance (Muralidharan et al. 2024, "Minitron", arXiv:2407.14679): the mean absolute
  activation of each MLP intermediate channel (the input of the down projection) over a sample;
  a narrower block keeps the largest channels, in their original order.
"""
from __future__ import annotations

from typing import Any
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from zgcore.models.adapters import capture_boundaries
from zgcore.models.channels import mlp_parts
from zgcore.models.families import adapter_for


@torch.no_grad()
def measure(teacher: nn.Module, tokens: np.ndarray, batch_size: int = 8) -> dict[str, list]:
    """Block influence of every teacher layer and the mean |activation| of every MLP channel.

    Args:
        teacher: a causal LM of a supported family. tokens: ``[n, seq_len]`` int token ids.

    Returns:
        ``{"influence": [L floats], "channels": [L lists of I floats]}``, averaged over all
        ``n * seq_len`` token positions (float64 accumulation).
    """
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

    handles = [mlp_parts(layer, ad)[1].register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
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
