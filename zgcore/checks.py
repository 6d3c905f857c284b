"""The error every configuration check raises, and the value checks the configuration modules share
(:mod:`zgcore.config.experiment`, :mod:`zgcore.config.distill`, :mod:`zgcore.data.sources`, :mod:`zgcore.local.config`).
Imports nothing of zgcore, so that every one of them can import it."""
from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """An experiment configuration that cannot run; the message says what to fix."""


def positive_int(where: str, v: Any, zero_ok: bool = False) -> None:
    """Check that ``v`` is a positive integer (``zero_ok``: non-negative); an integral float such as
    ``4.0`` passes, a bool does not.

    Raises:
        ConfigError: naming ``where`` (e.g. ``train.batch_size``) and the value given.
    """
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or v < (0 if zero_ok else 1):
        raise ConfigError(f"{where} must be a {'non-negative' if zero_ok else 'positive'} integer, got {v!r}")


def validate_lr_search(where: str, lrs: Any, rounds: Any) -> None:
    """Check a learning-rate search's settings (``<where>.lrs``, ``<where>.lr_rounds``; see
    :mod:`zgcore.training.lr_search`): ``lrs`` a list of distinct positive finite numbers ([] = no search),
    ``rounds`` a positive integer. Raises :class:`ConfigError` naming the key."""
    if lrs is None or isinstance(lrs, str) or not isinstance(lrs, (list, tuple)):
        raise ConfigError(f"{where}.lrs must be a list of peak learning rates ([] = no search), got {lrs!r}")
    for lr in lrs:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
            raise ConfigError(f"{where}.lrs entries must be finite numbers > 0, got {lr!r} in {list(lrs)!r}")
    if len({float(x) for x in lrs}) != len(lrs):
        raise ConfigError(f"{where}.lrs repeats a learning rate: {list(lrs)!r}")
    positive_int(f"{where}.lr_rounds", rounds)
