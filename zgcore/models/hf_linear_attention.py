"""Linear attention's chunked sums and a sliding window's banded softmax sums, for the converted
students' modelling code (:mod:`hf_converted_llama`, which imports this file relatively, so an
exported folder carries both). Imports nothing but ``torch``; uses flash-linear-attention (``fla``,
Yang et al., Triton kernels, CUDA only) where it is importable.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

KERNELS = ("auto", "torch", "fla")  # the parallel form of the linear mixers: see the module docstring
_FLA: list = []  # fla's chunk_linear_attn once looked up ([None]: not importable)


def fla_linear_attn():
    """fla's ``chunk_linear_attn(q, k, v, scale, ..., normalize)`` (``[B, T, H, K]`` layout), or
    ``None`` where ``fla`` or its Triton is not importable. Looked up once."""
    if not _FLA:
        try:
            from fla.ops.linear_attn import chunk_linear_attn
        except Exception:  # not installed, or installed without a working Triton
            chunk_linear_attn = None
        _FLA.append(chunk_linear_attn)
    return _FLA[0]


def chunked_linear_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float = 1.0,
                        normalize: bool = False, chunk: int = 64, **_) -> tuple[torch.Tensor, None]:
    """Causal linear attention's bare sums ``o_t = sum_{s <= t} (scale q_t . k_s) v_s`` in chunks, in
    plain PyTorch, with fla's ``chunk_linear_attn`` contract (``q``, ``k`` ``[B, T, H, K]``, ``v``
    ``[B, T, H, V]`` -> ``(o [B, T, H, V], None)``; ``normalize=False`` only): each chunk of
    ``chunk`` queries meets its own keys through a masked ``chunk x chunk`` product and the earlier
    chunks through their running state ``sum k_s v_s^T`` ``[K, V]``. Memory ``O(T (chunk + K V /
    chunk))``, never ``T x T``. Raises ``ValueError`` for ``normalize=True``."""
    if normalize:
        raise ValueError("chunked_linear_attn computes the bare sums only (normalize=False)")
    b, t, h, dk = q.shape
    c = int(chunk)
    n = -(-t // c)
    pad = n * c - t
    qc, kc, vc = (F.pad(x, (0, 0, 0, 0, 0, pad)).view(b, n, c, h, x.shape[-1]).permute(0, 3, 1, 2, 4)
                  for x in (q * scale, k, v))  # [B, H, n, c, .]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    intra = (qc @ kc.transpose(-1, -2)).masked_fill(~causal, 0) @ vc
    kv = kc.transpose(-1, -2) @ vc  # [B, H, n, K, V]: each chunk's own state
    before = kv.cumsum(2) - kv  # the state of every chunk before it
    o = (intra + qc @ before).permute(0, 2, 3, 1, 4).reshape(b, n * c, h, -1)[:, :t]
    return o, None


def window_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                 scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_j e_ij v_j [B, H, T, d], sum_j e_ij [B, H, T, 1])`` over each query's last ``window``
    keys (itself included), ``s_ij = scaling q_i . k_j`` and ``e_ij = exp(s_ij - max_j s_ij)`` (the
    stabiliser of the converted mixers' ``T x T`` form), for ``q``, ``k``, ``v`` ``[B, H, T, d]`` (keys
    and values already repeated to the query heads). In bands: each block of ``window`` queries meets
    its own block and the one before, never a ``T x T`` matrix."""
    b, h, t, d = q.shape
    w = min(int(window), t)  # a prompt inside one window: every earlier key is in it, bands of t
    nb = -(-t // w)
    pad = nb * w - t
    qb = F.pad(q, (0, 0, 0, pad)).view(b, h, nb, w, d)
    kb = F.pad(k, (0, 0, w, pad)).view(b, h, nb + 1, w, d)
    vb = F.pad(v, (0, 0, w, pad)).view(b, h, nb + 1, w, d)
    keys = torch.cat([kb[:, :, :-1], kb[:, :, 1:]], 3)  # [B, H, nb, 2w, d]: the block before, then its own
    vals = torch.cat([vb[:, :, :-1], vb[:, :, 1:]], 3)
    s = qb @ keys.transpose(-1, -2) * scaling  # [B, H, nb, w, 2w]
    a = torch.arange(w, device=q.device)[:, None]  # query offset in its block
    j = torch.arange(2 * w, device=q.device)[None, :]  # key offset; key position = block start - w + j
    inside = (j > a) & (j <= a + w)  # key in (query - w, query]
    first = torch.arange(nb, device=q.device).view(nb, 1, 1) == 0
    inside = inside & ~(first & (j < w))  # the first block has no block before it
    s = s.masked_fill(~inside, float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    num = (e @ vals).reshape(b, h, nb * w, d)[:, :, :t]
    den = e.sum(-1, keepdim=True).reshape(b, h, nb * w, 1)[:, :, :t]
    return num, den
