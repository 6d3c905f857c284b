"""Settings of end-to-end distillation (the ``heal`` section of an experiment, and the distillation
study's end-to-end arm): defaults and validation. Kept free of torch so that :mod:`zgcore.config`
can import it; the training itself is :mod:`zgcore.distill`."""
from __future__ import annotations

import math
from typing import Any, Mapping

HEAL_DEFAULTS: dict[str, Any] = {
    "steps": 0,  # 0 = no healing stage (no task, no hash change)
    "lr": 1e-4,  # AdamW peak
    "batch_size": 4,  # sequences per step
    "temperature": 1.0,  # softmax temperature of the logit KD (> 0)
    "hidden_weight": 0.0,  # weight of the hidden-state term at the interior boundaries (0 = logits only)
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "grad_clip": 1.0,
    "seed": 0,
    "checkpoint_every": 25,  # not hashed
}


def validate_distill(h: Mapping[str, Any], where: str = "heal") -> None:
    """Check a distillation section (``heal`` or ``distill``). Raises :class:`ConfigError`."""
    from .config import ConfigError, _positive_int  # local: zgcore.config imports this module

    _positive_int(f"{where}.steps", h["steps"], zero_ok=True)
    for k in ("lr", "temperature"):
        v = h[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise ConfigError(f"{where}.{k} must be a finite number > 0, got {v!r}")
    v = h["hidden_weight"]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
        raise ConfigError(f"{where}.hidden_weight must be a finite number >= 0 (0 = logits only), got {v!r}")
    for k in ("grad_clip", "weight_decay"):
        v = h[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
            raise ConfigError(f"{where}.{k} must be a finite number >= 0 (grad_clip 0 = no clipping), got {v!r}")
    for k in ("batch_size", "checkpoint_every"):
        _positive_int(f"{where}.{k}", h[k])
    for k in ("warmup_steps", "seed"):
        _positive_int(f"{where}.{k}", h[k], zero_ok=True)


DISTILL_DEFAULTS: dict[str, Any] = {
    **HEAL_DEFAULTS,
    "steps": 0,  # 0 = matched: as many student layer-token passes as the blockwise arm (zgcore.distill.e2e_steps)
    "lr": 3e-4,
}
