"""Shared set-up of the benchmarks: teacher, token rows, train settings, an in-memory boundary
source, and resident-memory probes. Nothing here touches Luigi."""
from __future__ import annotations

import copy
import glob
import json
import os
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import numpy as np
import torch

from zgcore.data import corpus
from zgcore.models import teacher as zteacher
from zgcore.config.defaults import DEFAULTS
from zgcore.models.shapes import kept_layers, resolve_boundaries


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
    interface of :class:`zgcore.data.boundary_store.BoundaryReader` (``n``, ``stats``, ``batches``).
    It is the reference for "the same step on tensors already in memory"."""

    def __init__(self, reader, boundaries):
        n = reader.n("train")
        self.data = {b: reader.read("train", b, np.arange(n)).float() for b in boundaries}  # the store's dtype, widened
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


def random_teacher(path: str | os.PathLike, n_layers: int, hidden: int, intermediate: int, heads: int = 16,
                   kv_heads: int = 4, layers_per_file: int = 8, seed: int = 0) -> dict[str, int]:
    """Write a randomly initialised Llama teacher (byte tokenizer, vocabulary 260) as a Hugging
    Face folder with sharded safetensors, one group of layers at a time, so that writing a large
    teacher never holds it whole in memory. Returns ``{"fp32_bytes", "per_layer_fp32_bytes"}``."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    from zgcore.models.teacher import byte_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(num_hidden_layers=n_layers, hidden_size=hidden, intermediate_size=intermediate,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=260, max_position_embeddings=512,
                      bos_token_id=256, eos_token_id=256, tie_word_embeddings=True)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items() if k != "lm_head.weight"}
    gen = torch.Generator().manual_seed(seed)
    make = lambda k: torch.ones(shapes[k]) if k.endswith("norm.weight") else torch.randn(shapes[k], generator=gen) * 0.02
    groups = [[k for k in shapes if not k.startswith("model.layers.")]]
    for lo in range(0, n_layers, layers_per_file):
        groups.append([k for k in shapes if k.startswith("model.layers.") and lo <= int(k.split(".")[2]) < lo + layers_per_file])
    weight_map, total = {}, 0
    for i, keys in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: make(k).contiguous() for k in keys}
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        total += sum(t.numel() * 4 for t in tensors.values())
        weight_map.update({k: name for k in keys})
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    cfg.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    per_layer = sum(int(np.prod(shapes[k])) * 4 for k in shapes if k.startswith("model.layers.0."))
    return {"fp32_bytes": total, "per_layer_fp32_bytes": per_layer}


def find_task(cfg_overrides: str, outputs: str | os.PathLike, family: str, index: int = 0):
    """The ``index``-th task of ``family`` in the experiment graph of ``cfg_overrides`` (no preset)."""
    from workflows.cli import walk
    from workflows.experiment import build_experiment, load_config

    tasks = [t for t in walk(build_experiment(load_config(overrides=cfg_overrides, preset=""), str(outputs)))
             if t.get_task_family() == family]
    return tasks[index]


def run_script(main, flag: str, child) -> None:
    """A benchmark script's entry point: ``script FLAG SPEC`` runs ``child(SPEC)`` (a subprocess
    of the benchmark), anything else exits with ``main()``'s code."""
    import sys

    if len(sys.argv) > 2 and sys.argv[1] == flag:
        child(sys.argv[2])
    else:
        sys.exit(main())


def as_format_3(folder: Path) -> Path:
    """Rewrite a format-5 (or 4) store in place as format 3 wrote it (``h`` chunked one sequence a chunk
    with Fletcher32, no ``xxh3``; the manifest's and shards' sizes, SHA-256 and format version
    updated), so that the reader's format-3 path can be tested and measured; returns ``folder``."""
    import json

    import h5py

    from zgcore.hashing import file_sha256

    folder = Path(folder)
    for f in folder.glob("shards/*/b*.h5"):
        with h5py.File(f, "r") as h:
            data = {k: h[k][...] for k in h if k != "xxh3"}
        with h5py.File(f, "w") as h:
            h.create_dataset("h", data=data["h"], chunks=(1, *data["h"].shape[1:]), fletcher32=True)
            if "sumsq" in data:
                h.create_dataset("sumsq", data=data["sumsq"], fletcher32=True)
        for rec in (folder / "manifest.json", f.parent / "shard.json"):
            m = json.loads(rec.read_text())
            m["format_version"] = 3
            entries = [m] if rec.name == "shard.json" else [sh for sh in m["shards"] if Path(sh["dir"]).name == f.parent.name]
            for sh in entries:
                sh["files"][f.stem].update(bytes=f.stat().st_size, sha256=file_sha256(f))
                for k in ("data", "outside_sha256"):  # format 5's open-time record: format 3 hashes the whole file
                    sh["files"][f.stem].pop(k, None)
            rec.write_text(json.dumps(m))
    return folder


def as_format_5(folder: Path) -> Path:
    """Relabel a format-6 store in place as format 5 (the same files: format 6 changed what its
    writer checks, not the bytes), so that the reader's format-5 path, which also checks every
    value finite at read, can be tested and measured; returns ``folder``."""
    import json

    folder = Path(folder)
    for rec in [folder / "manifest.json", *folder.glob("shards/*/shard.json")]:
        m = json.loads(rec.read_text())
        for entry in [m, *m.get("shards", [])]:
            if "format_version" in entry:
                entry["format_version"] = 5
        rec.write_text(json.dumps(m))
    return folder
