"""The error every configuration check raises. Imports nothing of zgcore, so that every module that checks
input (:mod:`zgcore.config`, :mod:`zgcore.data.sources`, :mod:`zgcore.local`, the models' shape checks) can
import it; the checks of a setting's value come from its declaration (:mod:`zgcore.config.fields`)."""
from __future__ import annotations


class ConfigError(ValueError):
    """An experiment configuration that cannot run; the message says what to fix."""
