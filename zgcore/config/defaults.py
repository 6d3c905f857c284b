"""Every experiment key's default, as plain nested dicts derived from the declarations in
:mod:`zgcore.config.schema` (``DEFAULTS``, ``HEAL_DEFAULTS``, ``DISTILL_DEFAULTS``), for the code that merges
a configuration over them. Data only: a default is changed where its setting is declared.

A configuration's hash is taken from its canonical values (:mod:`zgcore.hashing`), never from
where a default is written down.
"""
from __future__ import annotations

from typing import Any

from zgcore.config.fields import defaults, never_hashed
from zgcore.config.schema import Distill, Experiment, Heal

DEFAULTS: dict[str, Any] = defaults(Experiment)
HEAL_DEFAULTS: dict[str, Any] = defaults(Heal)
DISTILL_DEFAULTS: dict[str, Any] = defaults(Distill)
# Keys that change where results land but not what is computed are never hashed.
UNHASHED_TOP = never_hashed(Experiment)
