"""Fewer key-value heads in a student layer: grouped-query attention converted from the teacher's
attention by mean-pooling the key and value heads of each group.

Follows Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from
Multi-Head Checkpoints" (arXiv:2305.13245), section 2.1: each group's key and value projection
heads are initialised with the mean of the original heads in that group. Hugging Face attention
maps query head ``q`` to key-value head ``q // (heads / kv_heads)``, so the new head ``g`` serves
exactly the query heads that the teacher's heads ``g*r .. g*r + r - 1`` served (``r`` = teacher's
KV heads / the student's).
"""
from __future__ import annotations

import torch

from zgcore.checks import ConfigError

# families whose attention has k_proj / v_proj of [kv_heads * head_dim, hidden] (and optional bias)
# and no key norm over all KV heads at once (OLMo-2's k_norm spans kv_heads * head_dim)
KV_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def kv_heads(config) -> int:
    """The teacher's key-value head count (``num_key_value_heads``, else ``num_attention_heads``)."""
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def head_dim(config) -> int:
    """Per-head width: ``config.head_dim`` when set, else hidden / attention heads."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def check_kv_heads(config, n: int, where: str) -> None:
    """Raise :class:`ConfigError` unless a student may have ``n`` key-value heads: the family is in
    :data:`KV_FAMILIES` and ``n`` divides the teacher's KV head count."""
    if config.model_type not in KV_FAMILIES:
        raise ConfigError(f"{where}: fewer key-value heads are built for the {', '.join(KV_FAMILIES)} families, "
                          f"not {config.model_type!r}; remove kv_heads")
    t = kv_heads(config)
    if not (isinstance(n, int) and 1 <= n <= t and t % n == 0):
        raise ConfigError(f"{where}: kv_heads={n!r} must divide the teacher's {t} key-value heads "
                          f"(one of {[d for d in range(1, t + 1) if t % d == 0]})")


def group_kv(layer_sd: dict[str, torch.Tensor], config, n: int) -> dict[str, torch.Tensor]:
    """A teacher layer's weights with its key and value heads averaged into ``n`` groups.

    Args:
        layer_sd: one decoder layer's ``state_dict`` (``self_attn.k_proj.weight`` ``[kv*d, H]`` and
            ``self_attn.v_proj.weight``, biases ``[kv*d]`` where the family has them), any float dtype.
        config: the teacher's config. n: the student's KV heads (divides the teacher's).

    Returns:
        A new dict: the same tensors, with k/v projections ``[n*d, H]`` (biases ``[n*d]``), each
        group's mean in the input's dtype.
    """
    t, d = kv_heads(config), head_dim(config)
    if n == t:
        return dict(layer_sd)
    r = t // n
    out = dict(layer_sd)
    for k, v in layer_sd.items():
        if k.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
            rest = v.shape[1:]
            out[k] = v.reshape(n, r, d, *rest).float().mean(dim=1).reshape(n * d, *rest).to(v.dtype).contiguous()
    return out
