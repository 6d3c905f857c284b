"""Corpus: tokenize the documents of :mod:`zgcore.data.sources` into fixed-length sequences, split
train/validation, store as HDF5 — streaming, with peak memory bounded by ``corpus.buffer_tokens``.

The token store is one HDF5 file with datasets ``train`` and ``val`` (int32, ``[n, seq_len]``)
and attributes recording the tokenizer, the sources (used and skipped) and a content fingerprint
of the tokens.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any
from collections.abc import Mapping

import h5py
import numpy as np

from zgcore.atomic import atomic_path, set_aside
from zgcore.data import h5write, sources
from zgcore.checks import ConfigError

FORMAT_VERSION = 2  # 2: each row's document id (train_documents, val_documents)
DEFAULT_BUFFER = 1 << 20  # tokens held before full rows are flushed to disk (corpus.buffer_tokens)


def read_texts(corpus: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Return ``[(name, text), ...]`` of a (small) corpus in memory, in the store's order.

    For benchmarks and tests; :func:`build_token_store` streams instead.

    Raises:
        ConfigError: unreadable or malformed files, or no text at all.
    """
    docs: list[tuple[str, str]] = []
    for _src, _explicit, items in sources.documents(corpus, 0, []):
        docs += [(n, t) for n, t, _last in items if t.strip()]
    if not docs:
        raise ConfigError("the corpus holds no text")
    return docs


def tokenize(docs: list[tuple[str, str]], tokenizer, seq_len: int, max_tokens: int = 0, with_documents: bool = False):
    """Concatenate documents (each followed by the EOS token) and cut ``[n, seq_len]`` int32 rows.

    The tail that does not fill a row is dropped; ``max_tokens > 0`` truncates the stream first.
    With ``with_documents``, returns ``(rows, documents)``: also each row's document id (``[n]``
    int64, the document the row begins in, 0-based in ``docs`` order).
    """
    rows = _Rows(None, seq_len, max_tokens)
    for _, text in docs:
        if not rows.add(tokenizer, text, True):
            break
    out = rows.flush(final=True)
    return (out, rows.row_documents()) if with_documents else out


class _Rows:
    """Cuts a token stream into ``seq_len`` rows; appends full rows to HDF5 dataset ``dset``
    (resizable, ``[n, seq_len]`` int32) or, with ``dset=None``, keeps them."""

    def __init__(self, dset, seq_len: int, max_tokens: int):
        self.dset, self.seq_len, self.max_tokens = dset, seq_len, max_tokens
        self.parts: list[np.ndarray] = []  # pending tokens (int32 arrays), less than one row after a flush
        self.n_pending = 0
        self.kept: list[np.ndarray] = []
        self.n_rows = self.tokens = self.documents = 0
        self.starts: list[int] = []  # stream offset (tokens) where each document begins
        self.open = False  # a document is begun and not yet ended

    def add(self, tokenizer, text: str, last: bool) -> bool:
        """Tokenize ``text`` (EOS after a document's ``last`` piece); False once ``max_tokens`` is reached."""
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if last and tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        if self.max_tokens:
            ids = ids[: self.max_tokens - self.tokens]
        if not self.open:
            self.starts.append(self.tokens)
        self.open = not last
        self.parts.append(np.asarray(ids, dtype=np.int32))
        self.n_pending += len(ids)
        self.tokens += len(ids)
        self.documents += int(last)
        return not self.max_tokens or self.tokens < self.max_tokens

    def flush(self, final: bool = False) -> np.ndarray | None:
        """Write the pending full rows (the tail stays pending); ``final`` drops the tail and
        returns all rows when no dataset is written."""
        stream = np.concatenate(self.parts) if self.parts else np.zeros(0, np.int32)
        n = len(stream) // self.seq_len
        block = stream[: n * self.seq_len].reshape(n, self.seq_len)
        self.parts = [] if final else [stream[n * self.seq_len:].copy()]
        self.n_pending = sum(map(len, self.parts))
        if self.dset is None:
            self.kept.append(block)
        elif n:
            self.dset.resize(self.n_rows + n, axis=0)
            self.dset[self.n_rows:] = block
        self.n_rows += n
        if final and self.dset is None:
            return np.concatenate(self.kept)
        return None

    def row_documents(self) -> np.ndarray:
        """``[n_rows]`` int64: the document each row begins in (0-based, in reading order)."""
        starts = np.asarray(self.starts, dtype=np.int64)
        return np.searchsorted(starts, np.arange(self.n_rows, dtype=np.int64) * self.seq_len, side="right") - 1

    def mark(self) -> tuple:
        """The state to go back to if the next source turns out unreadable."""
        return self.n_rows, list(self.parts), self.n_pending, self.tokens, self.documents, len(self.starts), self.open

    def restore(self, state: tuple) -> None:
        """Forget everything added since :meth:`mark` returned ``state``."""
        self.n_rows, parts, self.n_pending, self.tokens, self.documents, n_starts, self.open = state
        del self.starts[n_starts:]
        self.parts = list(parts)
        self.dset.resize(self.n_rows, axis=0)


def val_count(n: int, val_fraction: float) -> int:
    """How many of ``n`` rows :func:`split_indices` holds out: ``max(1, round(n * val_fraction))``."""
    return max(1, round(n * val_fraction))


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic train/validation split of ``n`` rows by a seeded permutation:
    ``(train_idx, val_idx)``, each sorted (int64).

    Raises:
        ConfigError: fewer than two rows, i.e. a corpus too short for ``seq_len``.
    """
    n_val = val_count(n, val_fraction)
    if n < 2 or n - n_val < 1:
        raise ConfigError(f"the corpus gives only {n} sequence(s) of this length: need at least 2 "
                          "(one to train, one to validate); add text or lower corpus.seq_len")
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def split(rows: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` rows of :func:`split_indices`, each keeping the original row order."""
    train_idx, val_idx = split_indices(len(rows), val_fraction, seed)
    return rows[train_idx], rows[val_idx]


def fingerprint(train, val, chunk_rows: int = 4096) -> str:
    """SHA-256 over the token ids of both splits (content, not file bytes); arrays or HDF5
    datasets, read ``chunk_rows`` rows at a time."""
    h = hashlib.sha256()
    for a in (train, val):
        h.update(str(tuple(a.shape)).encode())
        for lo in range(0, len(a), chunk_rows):
            h.update(np.ascontiguousarray(a[lo: lo + chunk_rows], dtype="<i4").tobytes())
    return h.hexdigest()


def build_token_store(path: str | os.PathLike, corpus: Mapping[str, Any], tokenizer, tokenizer_name: str,
                      max_positions: int, log=print, cap_note=None) -> dict[str, Any]:
    """Tokenize the corpus and write the token store to ``path`` atomically, streaming.

    Documents are read one at a time (text files in pieces of :func:`piece_chars` characters
    cut at line ends; a real tokenizer may split a word differently at such a cut than in the
    whole file) and full rows go to a scratch HDF5 file every ``corpus.buffer_tokens`` tokens;
    then rows are split train/val (:func:`split_indices`) and copied ``buffer_tokens // seq_len``
    rows at a time. Peak memory is thus bounded by the buffer, not the corpus. The rows, the
    split and the fingerprint are those of tokenizing everything at once.

    Source files that cannot be read are skipped with a warning when they came through a glob
    (or are the stdlib's), counted in ``skipped_files``; an explicitly named one fails the run.

    Sources are read in order (a glob's files sorted by name) until ``corpus.max_tokens`` is
    reached: with a cap, the first files of a glob fill it and the later ones are never opened.
    When that happens one sentence saying so goes to ``cap_note`` (default: ``log``), e.g.
    ``corpus.max_tokens=2000 reached in the first 2 of 5 source file(s), read in name order: 3 never
    opened (corpus.max_tokens=0 reads everything)``.

    Returns the store's metadata (``fingerprint``, ``n_train``, ``n_val``, ``seq_len``, ``tokens``,
    ``documents``, ``source_files``, ``skipped_files``, ``skipped``).

    Raises:
        ConfigError: ``seq_len`` above the teacher's context ``max_positions``, an unreadable
            explicit file, empty or too-short corpus.
    """
    seq_len = int(corpus["seq_len"])
    if seq_len > max_positions:
        raise ConfigError(f"corpus.seq_len={seq_len} exceeds the teacher's context of {max_positions} tokens")
    buffer = int(corpus.get("buffer_tokens", DEFAULT_BUFFER))
    skipped: list[dict[str, str]] = []
    used, counts = 0, {}
    with atomic_path(path) as tmp:
        scratch = tmp.with_name(tmp.name + ".rows")
        try:
            with h5write.writing(scratch) as sf:
                rows = _Rows(sf.create_dataset("rows", (0, seq_len), np.int32, maxshape=(None, seq_len),
                                                chunks=(max(1, min(4096, buffer // seq_len)), seq_len)),
                             seq_len, int(corpus["max_tokens"]))
                more = True
                for src, explicit, docs in sources.documents(corpus, piece_chars(buffer), skipped, log, counts):
                    state = rows.mark()
                    try:
                        more = _add_source(rows, docs, tokenizer, buffer)
                        used += 1
                    except ConfigError as e:
                        if explicit:
                            raise
                        rows.restore(state)
                        log(f"warning: skipping corpus file {src}: {e}")
                        skipped.append({"file": src, "reason": str(e)})
                    if not more:
                        break
                if not more:  # max_tokens reached: say so, and what was left unread
                    unopened = counts["sources"] - used - len(skipped)
                    (cap_note or log)(f"corpus.max_tokens={int(corpus['max_tokens'])} reached in the first {used} of "
                                      f"{counts['sources']} source file(s), read in name order: {unopened} never opened "
                                      "(corpus.max_tokens=0 reads everything)")
                rows.flush(final=True)
                if not rows.tokens:
                    raise ConfigError("the corpus holds no text" + (f" ({len(skipped)} file(s) skipped)" if skipped else ""))
                meta = _write_split(tmp, sf["rows"], corpus, max(1, buffer // seq_len), rows.row_documents())
        finally:
            scratch.unlink(missing_ok=True)
        meta.update({"format_version": FORMAT_VERSION, "seq_len": seq_len, "tokens": meta.pop("n_rows") * seq_len,
                     "documents": rows.documents, "tokenizer": tokenizer_name, "vocab_size": len(tokenizer),
                     "source_files": used, "skipped_files": len(skipped), "skipped": skipped})
        with h5write.writing(tmp, "r+") as f:
            f.attrs["meta"] = json.dumps(meta, sort_keys=True)
    write_checksum(path)  # read_tokens checks every byte against it before any value is used
    return meta


def piece_chars(buffer_tokens: int) -> int:
    """Characters of a text file tokenised at once: ``buffer_tokens // 16`` (at least 4096). The
    tokenizer's transient memory grows with the text it is given (about 100 bytes per character
    for a fast tokenizer), so pieces are kept well below the token buffer."""
    return max(4096, buffer_tokens // 16)


def _add_source(rows: _Rows, docs, tokenizer, buffer: int) -> bool:
    """Tokenize one source's documents into ``rows``; False once ``max_tokens`` is reached."""
    whole = True  # the next piece starts a document
    for _name, text, last in docs:
        if not (whole and last and not text.strip()):  # a blank one-piece document adds nothing
            if not rows.add(tokenizer, text, last):
                return False
        whole = last
        if rows.n_pending >= buffer:
            rows.flush()
    return True


def _write_split(tmp, all_rows, corpus: Mapping[str, Any], chunk: int, documents: np.ndarray) -> dict[str, Any]:
    """Copy ``all_rows`` into ``train`` / ``val`` datasets of the HDF5 file ``tmp``, ``chunk`` rows at
    a time, and each row's document id (``documents``, ``[n]`` int64) into ``train_documents`` /
    ``val_documents``."""
    n, seq_len = all_rows.shape
    train_idx, val_idx = split_indices(n, float(corpus["val_fraction"]), int(corpus["split_seed"]))
    is_val = np.zeros(n, dtype=bool)
    is_val[val_idx] = True
    with h5write.writing(tmp) as f:
        out = {"train": f.create_dataset("train", (len(train_idx), seq_len), np.int32),
               "val": f.create_dataset("val", (len(val_idx), seq_len), np.int32)}
        at = {"train": 0, "val": 0}
        for lo in range(0, n, chunk):
            block, mask = all_rows[lo: lo + chunk], is_val[lo: lo + chunk]
            for name, part in (("train", block[~mask]), ("val", block[mask])):
                out[name][at[name]: at[name] + len(part)] = part
                at[name] += len(part)
        # kept referenced until the file closes (zgcore/data/h5write.py: a dataset dropped on a full disk crashes HDF5)
        out["docs"] = [f.create_dataset(f"{s}_documents", data=documents[m].astype(np.int64))
                       for s, m in (("train", ~is_val), ("val", is_val))]
        return {"fingerprint": fingerprint(out["train"], out["val"], chunk), "n_train": len(train_idx),
                "n_val": len(val_idx), "n_rows": n}


class TokenStoreError(RuntimeError):
    """A token store whose bytes are not those written (its ``.sha256`` differs) or that HDF5
    cannot read. The message names the file; the file has been moved aside so that the next run
    rebuilds it."""


SIDECAR = ".sha256"  # tokens.h5.sha256: the SHA-256 of tokens.h5's bytes, written with it
_verified: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> digest, checked once per process


def write_checksum(path: str | os.PathLike) -> str:
    """Write ``<path>.sha256`` (the file's SHA-256, hex) and return the digest."""
    from zgcore.hashing import file_sha256

    digest = file_sha256(path)
    with atomic_path(str(path) + SIDECAR) as tmp:
        tmp.write_text(digest + "\n")
    return digest


def _damaged(path, why: str, err: Exception | None = None):
    dest = set_aside(path)
    where = f"; moved it aside to {dest}, the next run rebuilds it" if dest else ""
    _verified.clear()
    raise TokenStoreError(f"token store {path}: {why}{where}") from err


def _open_verified(path: str | os.PathLike) -> h5py.File:
    """Open a token store for reading once its bytes match ``<path>.sha256`` (hashed once per
    process and file version: ~1.7 GB/s, one extra read). A store without the file (written before
    it existed) is opened unchecked. Any HDF5 error quarantines the file."""
    from zgcore.hashing import file_sha256

    path = os.fspath(path)
    side = path + SIDECAR
    if os.path.isfile(side):
        st = os.stat(path)
        key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
        if key not in _verified:
            try:
                want, got = open(side).read().strip(), file_sha256(path)
            except OSError as e:  # the file system's error (EIO, ESTALE, EMFILE...): nothing is moved
                _unavailable(path, e)
            if got != want:
                _damaged(path, f"checksum failure: SHA-256 {got[:12]}... differs from {side}'s {want[:12]}... "
                               "(the file changed after it was written)")
            _verified[key] = got
    try:
        return h5py.File(path, "r")
    except OSError as e:
        if not os.path.exists(path):
            raise
        if e.errno is not None:  # EMFILE, EIO, ESTALE...: the file system's error, not the file's
            _unavailable(path, e)
        _damaged(path, f"unreadable as HDF5 ({e})", e)


def _unavailable(path, e: OSError):
    """Raise :class:`TokenStoreError` for a token store the file system could not serve, one line
    naming the file and the system's error; the file stays where it is."""
    why = f"[Errno {e.errno}] {e.strerror}" if e.errno is not None and e.strerror else f"{type(e).__name__}: {e}"
    raise TokenStoreError(f"token store {path} could not be read ({why}); it is kept: rerun when the file system "
                          "answers again") from e


def read_tokens(path: str | os.PathLike, split_name: str) -> np.ndarray:
    """Load one split of a token store as ``[n, seq_len]`` int64, once the file's bytes match its
    recorded SHA-256.

    Raises:
        KeyError: a bad split name. FileNotFoundError: no such file.
        TokenStoreError: the file's bytes or HDF5 structure are damaged (the file is moved aside).
    """
    if split_name not in ("train", "val"):
        raise KeyError(f"token store splits are 'train' and 'val', not {split_name!r}")
    with _open_verified(path) as f:
        try:
            return f[split_name][...].astype(np.int64)
        except Exception as e:  # KeyError, OSError, ValueError from a damaged file
            if isinstance(e, OSError) and e.errno is not None:
                _unavailable(path, e)
            _damaged(path, f"split {split_name!r} unreadable ({type(e).__name__}: {e})", e)


def read_documents(path: str | os.PathLike, split_name: str) -> np.ndarray | None:
    """``[n]`` int64 document id of each row of one split (the document the row begins in; rows of
    one document are neighbours in the text), or ``None`` for a store written before format 2.
    Same checks as :func:`read_tokens`."""
    if split_name not in ("train", "val"):
        raise KeyError(f"token store splits are 'train' and 'val', not {split_name!r}")
    with _open_verified(path) as f:
        key = f"{split_name}_documents"
        return f[key][...].astype(np.int64) if key in f else None


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata dict written by :func:`build_token_store` (same checks as :func:`read_tokens`)."""
    with _open_verified(path) as f:
        try:
            return json.loads(f.attrs["meta"])
        except Exception as e:
            if isinstance(e, OSError) and e.errno is not None:
                _unavailable(path, e)
            _damaged(path, f"metadata unreadable ({type(e).__name__}: {e})", e)
