"""Online targets: :class:`OnlineBoundaries` computes boundaries with the frozen teacher inside
training, with the reader's interface, the store's rounding and the store's statistics."""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from zgcore.models.adapters import capture_boundaries
from . import codec as codec_mod
from .common import STATS_SEQUENCES, StoredForm, check_finite, rms_from_sumsq, round_trip, sequence_sumsq


class OnlineBoundaries:
    """Online targets: the same interface as :class:`~zgcore.data.boundary_store.BoundaryReader` for
    training, but boundaries are computed by running the frozen teacher on each batch instead of
    read from the cache.

    Values are rounded through the storage ``dtype`` exactly as a cache would store them, and the
    per-channel statistics come from the same first ``STATS_SEQUENCES`` sequences in the same
    batches, so an objective-matched run gives the same bits as with cached targets.

    Args:
        teacher: frozen causal LM or base model, loaded at least up to ``max(boundaries)``.
        tokens: training token ids ``[n, seq_len]`` (int).
        boundaries: the boundaries this block needs (e.g. ``[b_i, b_i+1]``). dtype: storage dtype name.
        batch_size: teacher batch size for the statistics pass (the cache build's ``batch_size``).
        codec: ``{"name", "keep"}`` of the store's boundary codec (``None`` / ``"none"``: ``dtype``): batches
            are then the codec's bytes, as a cached store's :meth:`read` gives them, decoded by :meth:`widen`.

    Raises:
        BoundaryStoreError: the teacher produced a non-finite boundary.

    Attributes:
        teacher_seconds: wall time spent in the teacher so far (s).
    """

    def __init__(self, teacher, tokens: np.ndarray, boundaries: Sequence[int], dtype: str, batch_size: int,
                 codec=None):
        self.teacher, self.tokens, self.dtype = teacher, tokens, dtype
        self.codec = codec_mod.make((codec or {}).get("name"), tokens.shape[1], int(teacher.config.hidden_size),
                                    int((codec or {}).get("keep", 0)))
        self._form = StoredForm(dtype, self.codec)
        self.boundaries = sorted(set(boundaries))
        self.device = next(teacher.parameters()).device
        seq_len = tokens.shape[1]
        n = min(len(tokens), STATS_SEQUENCES)
        rows = {b: [] for b in self.boundaries}
        t0 = time.perf_counter()
        for lo in range(0, n, batch_size):
            ids = torch.from_numpy(tokens[lo: min(lo + batch_size, len(tokens))].astype(np.int64)).to(self.device)
            for b, h in capture_boundaries(teacher, ids, self.boundaries).items():
                if self.codec is not None:  # the writer's own path: encoded, checked, decoded
                    stored = self._form.store(h, f"teacher output at boundary {b} (online targets)")
                    rows[b].append(sequence_sumsq(self._form.round_trip(h[: n - lo], stored[: n - lo])))
                    continue
                check_finite(round_trip(h, dtype), f"teacher output at boundary {b} (online targets, as {dtype})")
                rows[b].append(sequence_sumsq(round_trip(h[: n - lo], dtype)))
        self._stats = {b: rms_from_sumsq(torch.cat(rows[b]), seq_len) for b in self.boundaries}
        self.teacher_seconds = time.perf_counter() - t0

    def n(self, split_name: str) -> int:
        """Number of training sequences (only ``"train"`` is served online)."""
        return len(self.tokens)

    def stats(self, b: int) -> torch.Tensor:
        """Per-channel RMS of boundary ``b``, ``[2, hidden]`` float32 (as the reader's ``stats``)."""
        return self._stats[b]

    def read(self, split_name: str, b: int, idx) -> torch.Tensor:
        """Boundary ``b`` for sequences ``idx``, computed now: float32 ``[len(idx), seq_len, hidden]`` (with a
        codec: its bytes, uint8 ``[len(idx), sequence_bytes]``)."""
        return self._pair(idx, [b])[b]

    def _pair(self, idx, bs):
        t0 = time.perf_counter()
        ids = torch.from_numpy(self.tokens[np.asarray(idx)].astype(np.int64)).to(self.device)
        out = {}
        for b, h in capture_boundaries(self.teacher, ids, bs).items():
            if self.codec is not None:
                out[b] = torch.from_numpy(self._form.store(h, f"teacher output at boundary {b} (online targets)"))
                continue
            out[b] = round_trip(h, self.dtype).cpu()  # checked as rounded: float16 overflows above 65504, as in the store
            check_finite(out[b], f"teacher output at boundary {b} (online targets, as {self.dtype})")
        self.teacher_seconds += time.perf_counter() - t0
        return out

    def widen(self, t: torch.Tensor) -> torch.Tensor:
        """As the reader's ``widen``: float32 of a batch, decoded on its device with a codec."""
        return t.float() if self.codec is None else self.codec.decode(t)

    def batches(self, split_name: str, b_in: int, b_out: int, order: np.ndarray, batch_size: int,
                start: int = 0) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """As the reader's ``batches``, running the teacher once per batch for both boundaries."""
        n_batches = (len(order) + batch_size - 1) // batch_size
        for k in range(start, n_batches):
            caps = self._pair(order[k * batch_size: (k + 1) * batch_size], [b_in, b_out])
            yield k, caps[b_in], caps[b_out]

    def close(self) -> None:
        """Nothing to close (interface parity with the reader)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
