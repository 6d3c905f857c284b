"""Checks made when a workflow is built, before any task runs, whose bounds are those the tasks
enforce later: a run that passes them does not fail on the same bound after hours of work.

* the held-out split a comparison needs (:data:`MIN_HELD_OUT`, :func:`zgcore.evaluation.compare.compare`)
  and the validation rows an lr search scores on (:func:`zgcore.evaluation.metrics.tune_subset`), from
  the most sequences ``corpus.max_tokens`` allows and the split :func:`zgcore.data.corpus.split_indices` makes;
* an outputs folder that can be written (created when missing): a read-only, unwritable or
  not-a-folder ``--outputs`` is one line, not a traceback from the first task.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from zgcore.checks import ConfigError

MIN_HELD_OUT = 2  # compare() needs two held-out sequences (zgcore/evaluation/compare.py)


def _searching(cfg: dict[str, Any]) -> list[str]:
    from zgcore.config.experiment import block_train_config

    n = int(cfg["boundary"]["num_blocks"])
    return [f"blocks.{i}.lrs" for i in range(n) if block_train_config(cfg, i).get("lrs")]


def check_held_out(cfg: dict[str, Any]) -> None:
    """Check that the corpus can give what the comparisons and searches need later.

    ``eval.max_sequences`` (the test subset, 0 = every validation sequence) must be 0 or at least
    :data:`MIN_HELD_OUT`; with ``corpus.max_tokens`` set, the at most ``max_tokens // seq_len``
    sequences must leave at least one to train on and :data:`MIN_HELD_OUT` held out (the split of
    :func:`zgcore.data.corpus.split_indices`), and an lr search at least one validation sequence
    outside the test subset. A text source shorter than ``max_tokens`` is checked by the corpus's own
    split when it is read.

    Raises:
        ConfigError: naming the setting to change and the value that works."""
    from zgcore.data.corpus import val_count

    ms = int(cfg["eval"]["max_sequences"])
    if ms and ms < MIN_HELD_OUT:
        raise ConfigError(
            f"eval.max_sequences={ms}: a comparison needs at least {MIN_HELD_OUT} held-out sequences; set "
            f"eval.max_sequences >= {MIN_HELD_OUT} (0 = every validation sequence)"
        )
    c = cfg["corpus"]
    cap, seq_len, frac = int(c["max_tokens"]), int(c["seq_len"]), float(c["val_fraction"])
    if not cap:
        return
    n = cap // seq_len
    n_val = val_count(n, frac)
    if n - n_val < 1 or n_val < MIN_HELD_OUT:
        need = next(m for m in range(2, 10**7) if val_count(m, frac) >= MIN_HELD_OUT and m - val_count(m, frac) >= 1)
        raise ConfigError(
            f"corpus.max_tokens={cap} gives at most {n} sequence(s) of corpus.seq_len={seq_len} tokens, "
            f"{min(n, n_val)} held out at corpus.val_fraction={frac}: a comparison needs at least "
            f"{MIN_HELD_OUT} held-out sequences and training at least 1; set corpus.max_tokens >= "
            f"{need * seq_len} (or raise corpus.val_fraction)"
        )
    searching = _searching(cfg)
    if searching and ms and n_val <= ms:
        raise ConfigError(
            f"{searching[0]} scores its candidates on validation sequences outside the test subset, but "
            f"corpus.max_tokens={cap} gives at most {n_val} validation sequence(s), all inside "
            f"eval.max_sequences={ms}: lower eval.max_sequences below {n_val} or raise corpus.max_tokens"
        )


def check_outputs(outputs: str | os.PathLike) -> None:
    """Check that the outputs folder is a folder this process can write: create it (and its
    parents) when missing, then create and remove a probe file in it.

    Raises:
        ConfigError: one line naming the folder and the system's error (read-only file system,
            permission denied, a file in the way, no space)."""
    from zgcore.atomic import tmp_sibling

    p = Path(outputs)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"--outputs {p} is a file, not a folder: give a folder (it is created when missing)")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = tmp_sibling(p / "zerograph-write-probe")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ConfigError(
                f"the outputs folder {p.resolve()} has no space left ({e.strerror}): free space or give "
                "--outputs a bigger folder"
            ) from e
        raise ConfigError(
            f"the outputs folder {p.resolve()} cannot be written ({e.strerror or e}): give --outputs a "
            "folder you can write, or make this one writable"
        ) from e
