"""Corpus: read text, tokenize into fixed-length sequences, split train/validation, store as HDF5.

The token store is one HDF5 file with datasets ``train`` and ``val`` (int32, ``[n, seq_len]``)
and attributes recording the tokenizer, the sources and a content fingerprint of the tokens.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping

import h5py
import numpy as np

from .atomic import atomic_path
from .config import ConfigError, corpus_files

FORMAT_VERSION = 1


def read_texts(corpus: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Return ``[(name, text), ...]`` in a deterministic order.

    ``source="pydoc"`` gives the standard library's English reference text
    (``pydoc_data.topics``, sorted by topic). Files ending ``.jsonl`` contribute each record's
    ``text_field``; any other file is read as UTF-8 text.

    Raises:
        ConfigError: unreadable or malformed files, or no text at all.
    """
    if corpus["source"] == "pydoc":
        from pydoc_data.topics import topics

        docs = [(f"pydoc:{k}", topics[k]) for k in sorted(topics)]
    else:
        docs = []
        for f in corpus_files(corpus):
            try:
                if f.suffix == ".jsonl":
                    for n, line in enumerate(f.read_text(encoding="utf-8").splitlines()):
                        if not line.strip():
                            continue
                        rec = json.loads(line)
                        if corpus["text_field"] not in rec:
                            raise ConfigError(f"{f}:{n + 1} has no {corpus['text_field']!r} field")
                        docs.append((f"{f}:{n + 1}", str(rec[corpus["text_field"]])))
                else:
                    docs.append((str(f), f.read_text(encoding="utf-8")))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ConfigError(f"corpus file {f} cannot be read as text: {e}") from e
    docs = [(n, t) for n, t in docs if t.strip()]
    if not docs:
        raise ConfigError("the corpus holds no text")
    return docs


def tokenize(docs: list[tuple[str, str]], tokenizer, seq_len: int, max_tokens: int = 0) -> np.ndarray:
    """Concatenate documents (each followed by the EOS token) and cut ``[n, seq_len]`` int32 rows.

    The tail that does not fill a row is dropped; ``max_tokens > 0`` truncates the stream first.
    """
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for _, text in docs:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"]
        if eos is not None:
            stream.append(eos)
        if max_tokens and len(stream) >= max_tokens:
            break
    if max_tokens:
        stream = stream[:max_tokens]
    n = len(stream) // seq_len
    return np.asarray(stream[: n * seq_len], dtype=np.int32).reshape(n, seq_len)


def split(rows: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic train/validation split of rows by a seeded permutation.

    Returns ``(train, val)``, each keeping the original row order.

    Raises:
        ConfigError: fewer than two rows, i.e. a corpus too short for ``seq_len``.
    """
    n = len(rows)
    n_val = max(1, round(n * val_fraction))
    if n < 2 or n - n_val < 1:
        raise ConfigError(f"the corpus gives only {n} sequence(s) of this length: need at least 2 "
                          "(one to train, one to validate); add text or lower corpus.seq_len")
    perm = np.random.default_rng(seed).permutation(n)
    val_idx, train_idx = np.sort(perm[:n_val]), np.sort(perm[n_val:])
    return rows[train_idx], rows[val_idx]


def fingerprint(train: np.ndarray, val: np.ndarray) -> str:
    """SHA-256 over the token ids of both splits (content, not file bytes)."""
    h = hashlib.sha256()
    for a in (train, val):
        h.update(str(a.shape).encode())
        h.update(np.ascontiguousarray(a, dtype="<i4").tobytes())
    return h.hexdigest()


def build_token_store(path: str | os.PathLike, corpus: Mapping[str, Any], tokenizer, tokenizer_name: str,
                      max_positions: int) -> dict[str, Any]:
    """Tokenize the corpus and write the token store to ``path`` atomically.

    Returns the store's metadata (``fingerprint``, ``n_train``, ``n_val``, ``seq_len``, ``tokens``).

    Raises:
        ConfigError: ``seq_len`` above the teacher's context ``max_positions``, empty or too-short corpus.
    """
    seq_len = int(corpus["seq_len"])
    if seq_len > max_positions:
        raise ConfigError(f"corpus.seq_len={seq_len} exceeds the teacher's context of {max_positions} tokens")
    docs = read_texts(corpus)
    rows = tokenize(docs, tokenizer, seq_len, int(corpus["max_tokens"]))
    train, val = split(rows, float(corpus["val_fraction"]), int(corpus["split_seed"]))
    meta = {"format_version": FORMAT_VERSION, "fingerprint": fingerprint(train, val), "seq_len": seq_len,
            "n_train": len(train), "n_val": len(val), "tokens": int(rows.size), "documents": len(docs),
            "tokenizer": tokenizer_name, "vocab_size": len(tokenizer)}
    with atomic_path(path) as tmp:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("train", data=train)
            f.create_dataset("val", data=val)
            f.attrs["meta"] = json.dumps(meta, sort_keys=True)
    return meta


def read_tokens(path: str | os.PathLike, split_name: str) -> np.ndarray:
    """Load one split of a token store as ``[n, seq_len]`` int64. Raises ``KeyError`` for a bad split."""
    with h5py.File(path, "r") as f:
        return f[split_name][...].astype(np.int64)


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata dict written by :func:`build_token_store`."""
    with h5py.File(path, "r") as f:
        return json.loads(f.attrs["meta"])
