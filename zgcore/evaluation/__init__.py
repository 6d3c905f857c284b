"""Evaluation: measurement on held-out data (:mod:`.metrics`: cross-entropy in nats/token, context
use, boundary shift), scoring out-of-domain text (:mod:`.heldout_score`), comparisons between
models and methods (:mod:`.compare`, on the stored per-sequence scores of :mod:`.scores` and the
variance estimators of :mod:`.estimators`), training FLOPs (:mod:`.flops`), the experiment report
(:mod:`.report`, with its cache economics in :mod:`.economics`), study reports (:mod:`.study`,
:mod:`.distill_report`, :mod:`.library_report`) and their figures (:mod:`.plots`). May import the top-level
utilities, :mod:`zgcore.models`, :mod:`zgcore.data` and :mod:`zgcore.training`; never configuration
code.
"""
