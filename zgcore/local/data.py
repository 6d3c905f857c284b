"""Local-learning data: the model's vocabulary (``compact``, ``full``, ``top:N``), renumbering
tokenizer ids into model ids, and the tuning split a learning-rate sweep holds out of the
training split.

A ``top:N`` vocabulary is the ``N`` most frequent tokenizer ids of the training rows (ties: the
smaller id first) plus one UNK model id (the last, ``N``) that every other id maps to; its
``vocab_ids`` array records ``-1`` as the tokenizer id of UNK.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from zgcore.checks import ConfigError

UNK = -1  # tokenizer id recorded for the UNK model id of a ``top:N`` vocabulary


def parse_vocab(mode: Any) -> tuple[str, int]:
    """Parse ``model.vocab``: ``"compact"`` → ``("compact", 0)``, ``"full"`` → ``("full", 0)``,
    ``"top:N"`` → ``("top", N)``.

    Raises:
        ConfigError: anything else, or ``top:N`` with ``N`` not an integer >= 2.
    """
    if mode in ("compact", "full"):
        return str(mode), 0
    if isinstance(mode, str) and mode.startswith("top:"):
        n = mode[4:].strip()
        if n.isdigit() and int(n) >= 2:
            return "top", int(n)
        raise ConfigError(f"model.vocab={mode!r}: top:N needs an integer N >= 2 (the N most frequent training "
                          "token ids, plus one UNK id)")
    raise ConfigError(f"model.vocab must be 'compact', 'full' or 'top:N' (N >= 2), got {mode!r}")


def top_ids(train: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` most frequent ids of ``train`` (any shape, non-negative ints), most frequent
    first, ties broken by the smaller id; fewer when ``train`` holds fewer distinct ids. int64 ``[<=n]``."""
    counts = np.bincount(np.asarray(train, dtype=np.int64).ravel())
    present = np.flatnonzero(counts)
    order = np.lexsort((present, -counts[present]))  # by count descending, then id ascending
    return present[order][:n].astype(np.int64)


def vocab_ids(train: np.ndarray, val: np.ndarray, mode: str, tokenizer_vocab: int) -> np.ndarray:
    """The tokenizer id of each model id, int64 ``[V]``.

    ``compact``: the ids occurring in the token store (train and val; a model over the full
    vocabulary spends its capacity on the same ids, and on CPU the LM heads dominate the cost),
    sorted; ``full``: ``0..tokenizer_vocab-1``; ``top:N``: the ``N`` most frequent ids of ``train``
    (:func:`top_ids`), sorted, then :data:`UNK` (``-1``) for the extra UNK model id (``V = N + 1``).

    Raises:
        ConfigError: an unknown mode (:func:`parse_vocab`).
    """
    kind, n = parse_vocab(mode)
    if kind == "full":
        return np.arange(max(int(tokenizer_vocab), int(max(train.max(), val.max())) + 1), dtype=np.int64)
    if kind == "top":
        return np.append(np.sort(top_ids(train, n)), UNK).astype(np.int64)
    return np.unique(np.concatenate([np.unique(train), np.unique(val)])).astype(np.int64)


def remap(tokens: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Renumber tokenizer ids ``tokens`` (``[n, T]``) into model ids via ``ids`` (from
    :func:`vocab_ids`; int64 result, same shape). With a UNK entry (``ids[-1] == -1``) every id
    outside the vocabulary maps to the UNK model id ``len(ids) - 1``.

    Raises:
        ValueError: a token is not covered and the vocabulary has no UNK.
    """
    ids = np.asarray(ids, dtype=np.int64)
    unk = len(ids) > 0 and ids[-1] == UNK
    known = ids[:-1] if unk else ids
    if len(known) == 0:
        out = np.zeros(np.shape(tokens), dtype=np.int64)
        miss = np.ones(np.shape(tokens), dtype=bool)
    else:
        out = np.searchsorted(known, tokens)
        miss = (out >= len(known)) | (known[np.minimum(out, len(known) - 1)] != tokens)
    if miss.any():
        if not unk:
            raise ValueError("a token id is outside the model's vocabulary")
        out = np.where(miss, len(ids) - 1, out)
    return out.astype(np.int64)


def holdout_split(n: int, n_tune: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split ``n`` training rows into ``(train_idx, tune_idx)`` (each sorted int64) with
    ``n_tune`` rows for tuning, chosen by a seeded permutation (``numpy.random.default_rng((seed,
    7))``): the same rows for every configuration of a study, whatever it trains. ``n_tune = 0``
    keeps every row for training.

    Raises:
        ConfigError: ``n_tune`` leaves no training row (``study.tune_sequences`` too large).
    """
    if n_tune <= 0:
        return np.arange(n, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if n_tune >= n:
        raise ConfigError(f"study.tune_sequences={n_tune} leaves no training sequence (the training split has {n}); "
                          "lower it")
    perm = np.random.default_rng((int(seed), 7)).permutation(n)
    return np.sort(perm[n_tune:]).astype(np.int64), np.sort(perm[:n_tune]).astype(np.int64)


def model_splits(train: np.ndarray, val: np.ndarray, setup: dict, tokenizer_vocab: int) -> dict[str, np.ndarray]:
    """The splits one configuration ``setup`` (a normalised run) works on, in model ids.

    ``train``/``val`` are the token store's splits (``[n, T]`` tokenizer ids). The tuning rows
    (``setup["train"]["holdout_sequences"]``, 0 when absent; :func:`holdout_split` with
    ``train.data_seed``) leave the training rows; a ``top:N`` vocabulary is counted on the
    remaining training rows only.

    Returns:
        ``{"ids": [V] int64, "train": [n_train, T], "tune": [n_tune, T], "val": [n_val, T]}`` (int64 model ids).
    """
    t = setup["train"]
    tr_idx, tune_idx = holdout_split(len(train), int(t.get("holdout_sequences", 0) or 0), int(t["data_seed"]))
    fit, tune = (train, train[:0]) if len(tune_idx) == 0 else (train[tr_idx], train[tune_idx])
    mode = setup["model"]["vocab"]
    # compact covers every stored id (tuning rows included); top:N counts the rows trained on only
    ids = vocab_ids(fit if parse_vocab(mode)[0] == "top" else train, val, mode, tokenizer_vocab)
    return {"ids": ids, "train": remap(fit, ids), "tune": remap(tune, ids), "val": remap(val, ids)}
