"""Tokenising and scoring the out-of-domain held-out corpora of ``eval.extra`` (the
settings are :mod:`zgcore.data.heldout`'s)."""
from __future__ import annotations

import hashlib
from typing import Any
from collections.abc import Mapping

import numpy as np

from zgcore.checks import ConfigError


def tokenize_extra(spec: Mapping[str, Any], tokenizer, seq_len: int) -> tuple[np.ndarray, dict[str, Any]]:
    """Tokenise one held-out corpus (a :func:`zgcore.data.heldout.extra_corpora` entry) into rows.

    The text is read into memory (held-out text is evaluation-sized; cap it with ``max_tokens``).

    Returns:
        ``(rows, meta)``: int32 ``[n, seq_len]`` token ids and ``{"name", "source", "documents",
        "characters", "tokens", "rows", "seq_len", "fingerprint"`` (SHA-256 of the rows as int32),
        ``"row_documents"`` (each row's document id, so comparisons resample whole documents)``}``.

    Raises:
        ConfigError: unreadable text, or fewer than two full rows (a paired bootstrap needs two sequences).
    """
    from zgcore.data.corpus import read_texts, tokenize

    docs = read_texts({"source": spec["source"], "text_field": spec["text_field"]})
    rows, row_docs = tokenize(docs, tokenizer, int(seq_len), int(spec["max_tokens"]), with_documents=True)
    if len(rows) < 2:
        raise ConfigError(f"eval.extra {spec['name']!r} gives {len(rows)} sequence(s) of {seq_len} tokens; it needs at "
                          "least 2: add text or raise max_tokens")
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    meta = {"name": spec["name"], "source": spec["source"], "documents": len(docs),
            "characters": sum(len(t) for _, t in docs), "tokens": int(rows.size), "rows": int(len(rows)),
            "seq_len": int(seq_len), "fingerprint": hashlib.sha256(rows.astype("<i4").tobytes()).hexdigest(),
            "row_documents": [int(x) for x in row_docs[: len(rows)]]}
    return rows, meta


def score(corpora: list[tuple[Mapping[str, Any], np.ndarray]], models, eval_cfg: Mapping[str, Any]
          ) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Score every model on every held-out corpus (the same seeded subset rule as the validation
    split: :func:`zgcore.evaluation.metrics.eval_subset` with ``eval.max_sequences`` and ``eval.subset_seed``).

    Args:
        corpora: ``(meta, rows)`` per corpus: :func:`tokenize_extra`'s meta and its rows ``[n, seq_len]``.
        models: ``(key, causal LM)`` pairs, e.g. teacher, untrained, student.
        eval_cfg: the ``eval`` settings (``batch_size``, ``max_sequences``, ``subset_seed``).

    Returns:
        ``(entries, parts)``: per corpus ``{"name", "source", "sequences", "of", "tokens",
        "subset_sha256", "cross_entropy": {key: nats/token}}``, and ``{name: part}`` of
        :func:`zgcore.evaluation.compare.scores_part` (per-sequence CE) for :func:`zgcore.evaluation.compare.save_scores`.
    """
    from zgcore.evaluation.compare import scores_part
    from zgcore.evaluation.metrics import eval_subset, sequence_cross_entropy

    entries, parts = [], {}
    for meta, all_rows in corpora:
        idx = eval_subset(len(all_rows), int(eval_cfg["max_sequences"]), int(eval_cfg["subset_seed"]))
        rows = all_rows[idx]
        per_seq = {k: sequence_cross_entropy(m, rows, int(eval_cfg["batch_size"]), desc=f"CE {k} on {meta['name']}")
                   for k, m in models}
        docs = meta.get("row_documents")  # absent from a store written before documents were recorded
        part = scores_part(per_seq, idx, None if docs is None else np.asarray(docs, dtype=np.int64)[idx])
        parts[meta["name"]] = part
        entries.append({"name": meta["name"], "source": meta["source"], "sequences": int(len(idx)),
                        "of": int(len(all_rows)), "tokens": int(rows.size), "subset_sha256": part["subset_sha256"],
                        "cross_entropy": {k: float(v.mean()) for k, v in per_seq.items()}})
    return entries, parts


def entry(scored: Mapping[str, Any], part: Mapping[str, Any]) -> dict[str, Any]:
    """One corpus's report entry (as :func:`score` returns) from a scoring task's record ``scored``
    (``name``, ``source``, ``of``, ``tokens``) and the part (:func:`zgcore.evaluation.compare.scores_part`)
    of every model's per-sequence CE on it."""
    return {"name": scored["name"], "source": scored["source"], "sequences": int(part["sequences"]), "of": int(scored["of"]),
            "tokens": int(scored["tokens"]), "subset_sha256": part["subset_sha256"],
            "cross_entropy": {k: float(np.asarray(v, dtype=np.float64).mean()) for k, v in part["ce"].items()}}
