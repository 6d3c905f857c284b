"""Configuration: how an experiment is described and checked before any work — every key declared
once with its type, default, allowed values, hash rule and meaning (:mod:`.schema`, on the field helper
:mod:`.fields`; plain defaults derived in :mod:`.defaults`), experiment files, ``--set`` overrides and
validation (:mod:`.experiment`, :mod:`.overrides`), the distillation sections (:mod:`.distill`) and
local paths made canonical before hashing (:mod:`.paths`). It sits above the layers whose
registries it checks values against (corpus sources, objectives, student shapes), so that models,
data, training and evaluation take plain values and never import it. May import the top-level
utilities, :mod:`zgcore.models`, :mod:`zgcore.data`, :mod:`zgcore.training` and
:mod:`zgcore.evaluation`. The generated reference, ``docs/configuration.md``, is written by
:mod:`workflows.reference` from the declarations, local learning's (:mod:`zgcore.local.schema`) too.
"""
