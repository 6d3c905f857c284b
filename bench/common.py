"""Shared set-up of the benchmarks: teacher, token rows, train settings, an in-memory boundary
source, and resident-memory probes. Nothing here touches Luigi."""
from __future__ import annotations

import copy
import glob
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from zgcore import corpus
from zgcore import teacher as zteacher
from zgcore.config import DEFAULTS, kept_layers, resolve_boundaries


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def teacher_record(spec: str, outputs: str | os.PathLike) -> dict[str, Any]:
    """The teacher record to load, preferring a Hugging Face folder already converted by the
    pipeline's PrepareTeacher (loads in seconds) over de-quantising the GGUF again."""
    for rec_path in sorted(glob.glob(str(Path(outputs) / "PrepareTeacher" / "*" / "teacher.json"))):
        rec = zteacher.read_record(rec_path)
        if rec.get("spec") == spec:
            if rec["path"] == "model":
                rec["path"] = str((Path(rec_path).parent / "model").resolve())
            if Path(rec["path"]).is_dir():
                return rec
    return zteacher.materialise(spec, outputs, log=log)


def load_teacher(spec: str, outputs: str | os.PathLike):
    """``(record, model, tokenizer)``; the model is float32, eval, on CPU."""
    rec = teacher_record(spec, outputs)
    model, tok = zteacher.load(rec, "cpu")
    return rec, model, tok


def token_rows(tok, seq_len: int, n_sequences: int) -> np.ndarray:
    """The first ``n_sequences`` rows of ``seq_len`` tokens of the default corpus (pydoc text)."""
    c = copy.deepcopy(DEFAULTS["corpus"])
    rows = corpus.tokenize(corpus.read_texts(c), tok, seq_len, max_tokens=n_sequences * seq_len)
    if len(rows) < n_sequences:
        raise SystemExit(f"the corpus gives only {len(rows)} rows of {seq_len} tokens; ask for fewer tokens")
    return rows


def split_tokens(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Train/validation split of ``rows`` exactly as the pipeline does it (default fraction and seed)."""
    train, val = corpus.split(rows, float(DEFAULTS["corpus"]["val_fraction"]), int(DEFAULTS["corpus"]["split_seed"]))
    return {"train": train, "val": val}


def train_settings(batch_size: int, **over) -> dict[str, Any]:
    """The default per-block train settings (one epoch, clean regression) with ``batch_size``."""
    t = copy.deepcopy(DEFAULTS["train"])
    t["batch_size"] = batch_size
    t.update(over)
    return t


def plan_blocks(n_layers: int, num_blocks: int, t) -> tuple[list[int], list[list[int]]]:
    """Boundaries and each block's kept teacher layers, as the pipeline resolves them."""
    bs = resolve_boundaries({**DEFAULTS["boundary"], "num_blocks": num_blocks}, n_layers)
    return bs, [kept_layers(bs[i], bs[i + 1], t) for i in range(len(bs) - 1)]


class InMemoryBoundaries:
    """The training split of two boundaries held as float32 tensors in memory, served with the
    interface of :class:`zgcore.boundary_store.BoundaryReader` (``n``, ``stats``, ``batches``).
    It is the reference for "the same step on tensors already in memory"."""

    def __init__(self, reader, boundaries):
        n = reader.n("train")
        self.data = {b: reader.read("train", b, np.arange(n)) for b in boundaries}
        self._stats = {b: reader.stats(b) for b in boundaries}
        self._n = n

    def n(self, split_name: str) -> int:
        return self._n

    def stats(self, b: int) -> torch.Tensor:
        return self._stats[b]

    def batches(self, split_name, b_in, b_out, order, batch_size, start=0) -> Iterator:
        n_batches = (len(order) + batch_size - 1) // batch_size
        for k in range(start, n_batches):
            idx = torch.from_numpy(np.asarray(order[k * batch_size: (k + 1) * batch_size], dtype=np.int64))
            yield k, self.data[b_in][idx], self.data[b_out][idx]

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def proc_status_kb(key: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak_rss() -> bool:
    """Reset this process's resident high-water mark (``VmHWM``) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def dump(path: str | os.PathLike, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=1, sort_keys=True))
