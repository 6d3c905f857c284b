"""Boundary codecs (``boundary.codec``): what a store holds per sequence instead of the float32 /
16-bit residual stream, and how it is turned back into float32 after the copy to the block's device.

Every codec stores one sequence ``h`` ``[seq_len, hidden]`` as one byte string (a row of dataset ``h``,
uint8 ``[rows, sequence_bytes]``): the codes and every scale side by side, so the store's xxh3_64 per
sequence covers both, and a read moves the encoded bytes only. All three keep position 0 (the attention
sink, whose values sit far above the rest; Sun et al. 2024, arXiv 2402.17762) in bfloat16, and the ``keep``
channels of largest RMS over the sequence's positions >= 1 (the massive channels) in bfloat16 with their
indices; the rest of positions ``1 .. seq_len - 1`` is coded with one float32 scale per token (its absolute
maximum mapped to the code's largest value; per-token against per-channel and per-block scales:
docs/storage.md):

* ``fp8``: float8 e4m3 (largest 448);
* ``int8``: symmetric int8 (-127..127);
* ``int4``: rotated by a fixed seeded randomized Hadamard transform first (random signs, then Walsh-Hadamard
  over blocks of the largest power of two dividing ``hidden``, at most 256; QuaRot, arXiv 2404.00456), then
  symmetric int4 (-7..7, two per byte).

Encoding is elementwise or per sequence (no matrix product whose rounding could depend on the batch), so a
sequence's bytes never depend on the batch it came in; online targets pass through the same :meth:`Codec.encode`
and :meth:`Codec.decode` (int4: one matrix product per rotation block, on the same batch shapes either way) and
are bitwise the cached ones.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

NAMES = ("none", "fp8", "int8", "int4")
DEFAULT_KEEP = 8  # boundary.codec_keep: channels kept in bfloat16
ROTATION_SEED = 20240417  # the int4 codec's random signs (fixed: part of the format, never configured)
MAX_ROTATION_BLOCK = 256
FP8_MAX = 448.0  # float8 e4m3fn's largest finite value
CODE_MAX = {"fp8": FP8_MAX, "int8": 127, "int4": 7}


def rotation_block(hidden: int) -> int:
    """The Walsh-Hadamard block of the int4 codec: the largest power of two dividing ``hidden``, at most 256
    (hidden 576 -> 64, 4096 -> 256)."""
    return min(hidden & -hidden, MAX_ROTATION_BLOCK)


@functools.lru_cache(maxsize=16)
def _signs(hidden: int, device) -> torch.Tensor:
    rng = np.random.default_rng(ROTATION_SEED)
    return torch.from_numpy((rng.integers(0, 2, hidden) * 2 - 1).astype(np.float32)).to(device)


def hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of each ``block`` consecutive channels of ``x`` ``[..., hidden]``
    (float32; its own inverse), by butterflies: additions only, then one exact power-of-two scale where
    ``block`` is a power of four, else a float32 multiply."""
    shape, h = x.shape, 1
    y = x.reshape(-1, block)
    while h < block:
        y = y.view(-1, block // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(shape) * (1.0 / math.sqrt(block))


@functools.lru_cache(maxsize=16)
def _hadamard_matrix(block: int, device) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix of ``block`` (float32, symmetric: :func:`hadamard` of the identity)."""
    return hadamard(torch.eye(block, device=device), block)


@dataclass(frozen=True)
class Codec:
    """One codec over sequences of ``seq_len`` tokens of ``hidden`` channels.

    Attributes:
        name: one of :data:`NAMES` other than ``"none"``. keep: channels kept in bfloat16.
    """

    name: str
    seq_len: int
    hidden: int
    keep: int = 0
    sections: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.name not in NAMES[1:]:
            raise ValueError(f"boundary.codec must be one of {', '.join(NAMES)}, got {self.name!r}")
        if self.seq_len < 2 or self.hidden < 2 or self.hidden % 2:
            raise ValueError(
                f"a boundary codec needs seq_len >= 2 and an even hidden size, got {self.seq_len}, {self.hidden}"
            )
        if not 0 <= self.keep < self.hidden:
            raise ValueError(f"boundary.codec_keep must be in 0..{self.hidden - 1}, got {self.keep}")
        t, h, k = self.seq_len - 1, self.hidden, self.keep
        code = h if self.name in ("fp8", "int8") else h // 2
        parts = [("pos0", 2 * h), ("scale", 4 * t), ("idx", 2 * k), ("kept", 2 * t * k), ("codes", t * code)]
        off, sections = 0, {}
        for name, n in parts:
            sections[name] = (off, n)
            off += n
        object.__setattr__(self, "sections", sections)

    @property
    def sequence_bytes(self) -> int:
        """Bytes one sequence takes in the store (codes, scales, kept channels, position 0)."""
        off, n = self.sections["codes"]
        return off + n

    @property
    def bits(self) -> float:
        """Bits per stored element, everything counted (``8 * sequence_bytes / (seq_len * hidden)``)."""
        return 8 * self.sequence_bytes / (self.seq_len * self.hidden)

    def record(self) -> dict[str, Any]:
        """What a store's manifest records of the codec (enough to decode it: :func:`from_record`)."""
        out = {"name": self.name, "keep": self.keep, "bits": self.bits}
        if self.name == "int4":
            out |= {"rotation": "randomized_hadamard", "block": rotation_block(self.hidden), "seed": ROTATION_SEED}
        return out

    def kept_channels(self, h: torch.Tensor) -> torch.Tensor:
        """The ``keep`` channels of largest energy over positions >= 1 of each sequence of ``h`` float32
        ``[n, seq_len, hidden]`` (ties: the lower channel), ascending: int64 ``[n, keep]``."""
        ss = h[:, 1:].double().pow(2).sum(1)
        return torch.sort(ss, dim=1, descending=True, stable=True).indices[:, : self.keep].sort(1).values

    # -- encoding (on the CPU, float32 in)

    def encode(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode ``h`` float32 ``[n, seq_len, hidden]`` (finite) -> ``(bytes uint8 [n, sequence_bytes], scales
        float32)``; the scales are in the bytes too and returned for the writer's finiteness check."""
        h = h.detach().float().cpu()
        n, t = len(h), self.seq_len - 1
        rest = h[:, 1:]
        parts = {"pos0": _bytes(h[:, 0].bfloat16())}
        if self.keep:
            idx = self.kept_channels(h)
            gi = idx[:, None, :].expand(n, t, self.keep)
            parts["idx"] = _bytes(idx.to(torch.int16))
            parts["kept"] = _bytes(rest.gather(2, gi).bfloat16())
            rest = rest.scatter(2, gi, 0.0)
        if self.name == "int4":
            rest = hadamard(rest * _signs(self.hidden, rest.device), rotation_block(self.hidden))
        q = CODE_MAX[self.name]
        amax = rest.abs().amax(2)  # [n, t]: one scale per token
        scale = torch.where(amax > 0, amax / q, torch.ones_like(amax))
        if self.name == "fp8":
            codes = (rest / scale[..., None]).clamp(-q, q).to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            codes = torch.round(rest / scale[..., None]).clamp(-q, q)
            if self.name == "int8":
                codes = codes.to(torch.int8).view(torch.uint8)
            else:
                u = (codes + 8).to(torch.uint8)
                codes = u[..., 0::2] | (u[..., 1::2] << 4)
        parts["scale"] = _bytes(scale.float())
        parts["codes"] = codes.reshape(n, -1)
        out = torch.empty(n, self.sequence_bytes, dtype=torch.uint8)
        for name, (off, size) in self.sections.items():
            if size:
                out[:, off : off + size] = parts[name].reshape(n, size)
        return out, scale

    # -- decoding (on the block's device)

    def decode(self, b: torch.Tensor) -> torch.Tensor:
        """Decode ``b`` uint8 ``[n, sequence_bytes]`` (any device) -> float32 ``[n, seq_len, hidden]`` there."""
        if b.dim() != 2 or b.shape[1] != self.sequence_bytes:
            raise ValueError(f"{self.name} codes must be uint8 [n, {self.sequence_bytes}], got {tuple(b.shape)}")
        n, t, hdim = len(b), self.seq_len - 1, self.hidden
        out = torch.empty(n, self.seq_len, hdim, dtype=torch.float32, device=b.device)
        out[:, 0] = self._part(b, "pos0", torch.bfloat16).view(n, hdim)
        scale = self._part(b, "scale", torch.float32)
        off, size = self.sections["codes"]
        codes = b[:, off : off + size].reshape(n, t, -1)
        rest = out[:, 1:]
        if self.name == "fp8":  # e4m3's bits as float16's (exponent bias 15, not 7): 2^-8 times the value, exactly
            bits = (codes & 0x7F).to(torch.int16).mul_(128).add_((codes & 0x80).to(torch.int16).mul_(256))
            # bitwise fp8.float() * scale (256 * scale is exact), at 2-4x the speed of torch's float8 conversion
            torch.mul(bits.view(torch.float16), scale.view(n, t, 1) * 256.0, out=rest)
        elif self.name == "int8":
            torch.mul(codes.view(torch.int8), scale.view(n, t, 1), out=rest)
        else:
            q = torch.empty(n, t, hdim // 2, 2, dtype=torch.int8, device=b.device)
            torch.bitwise_and(codes, 15, out=q[..., 0])
            torch.bitwise_right_shift(codes, 4, out=q[..., 1])
            y = torch.mul(q.view(n, t, hdim).sub_(8), scale.view(n, t, 1))
            blk = rotation_block(hdim)  # the inverse rotation as one matrix product per block (the same shapes
            # whichever way the batch came, cached or online, so the same bits)
            torch.mul(
                (y.view(-1, blk) @ _hadamard_matrix(blk, b.device)).view(n, t, hdim), _signs(hdim, b.device), out=rest
            )
        if self.keep:
            idx = self._part(b, "idx", torch.int16).view(n, 1, self.keep).long().expand(n, t, self.keep)
            rest.scatter_(2, idx, self._part(b, "kept", torch.bfloat16).view(n, t, self.keep).float())
        return out

    def _part(self, b: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
        off, size = self.sections[name]
        return b[:, off : off + size].contiguous().view(dtype).float()

    def bound(self, h: torch.Tensor) -> torch.Tensor:
        """The codec's stated error bound: the largest ``|decode(encode(h)) - h|`` it allows per element,
        float32 ``[n, seq_len, hidden]``, for ``h`` float32 ``[n, seq_len, hidden]``: bfloat16's half step
        ``2^-8 |x|`` for position 0 and the kept channels; fp8, ``2^-4 |x| + 2^-10 s_t`` (e4m3's half step,
        normal and subnormal, at token scale ``s_t``); int8, ``s_t / 2``; int4, ``sqrt(B) s_t / 2`` (block
        ``B``: the rotation spreads each rotated code's error over ``B`` channels); plus ``1e-6 |x|`` of
        float32 arithmetic."""
        _, scale = self.encode(h)
        h = h.float()
        tol = h.abs() * 2.0**-8
        rest = h[:, 1:].abs()
        if self.name == "fp8":
            r = rest * 2.0**-4 + scale[..., None] * 2.0**-10
        elif self.name == "int8":
            r = (scale / 2)[..., None].expand_as(rest)
        else:
            r = (scale * math.sqrt(rotation_block(self.hidden)) / 2)[..., None].expand_as(rest)
        if self.keep:
            gi = self.kept_channels(h)[:, None, :].expand(-1, r.shape[1], -1)
            r = r.clone().scatter_(2, gi, rest.gather(2, gi) * 2.0**-8)
        tol[:, 1:] = r
        return tol + h.abs() * 1e-6


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, uint8 ``[n, bytes]`` per leading row."""
    t = t.contiguous()
    return t.view(torch.uint8).reshape(len(t), -1) if t.dtype != torch.uint8 else t.reshape(len(t), -1)


def settings(boundary: Mapping[str, Any]) -> dict[str, Any] | None:
    """``{"name", "keep"}`` of a ``boundary`` section's codec for the store's writer and online targets;
    ``None`` at ``"none"`` (the store keeps ``boundary.dtype`` as it is)."""
    name = boundary.get("codec", "none")
    return None if name == "none" else {"name": name, "keep": int(boundary.get("codec_keep", DEFAULT_KEEP))}


def make(name: str | None, seq_len: int, hidden: int, keep: int = DEFAULT_KEEP) -> Codec | None:
    """The codec ``name`` for sequences of ``seq_len x hidden`` (``None`` for ``"none"`` or ``None``: the
    store's plain float32 / 16-bit path). Raises ``ValueError`` for an unknown name or a bad ``keep``."""
    if name in (None, "none"):
        return None
    return Codec(str(name), int(seq_len), int(hidden), int(keep))


def from_record(rec: Mapping[str, Any] | None, seq_len: int, hidden: int) -> Codec | None:
    """The codec a manifest's ``codec`` entry (:meth:`Codec.record`) describes; ``None`` when absent."""
    return None if not rec else make(rec["name"], seq_len, hidden, int(rec.get("keep", 0)))
