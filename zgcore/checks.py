"""The error every configuration check raises, and the value checks the configuration modules share
(:mod:`zgcore.config`, :mod:`zgcore.distill_config`, :mod:`zgcore.sources`, :mod:`zgcore.local.config`).
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
