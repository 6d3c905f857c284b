"""Evaluation: measurement on held-out data (:mod:`.metrics`: cross-entropy in nats/token, context
use, boundary shift), scoring out-of-domain text (:mod:`.heldout_score`), comparisons between
models and methods (:mod:`.compare`), the experiment report (:mod:`.report`), study reports
(:mod:`.study`, :mod:`.distill_report`) and their figures (:mod:`.plots`). May import the top-level
utilities, :mod:`zgcore.models`, :mod:`zgcore.data` and :mod:`zgcore.training`; never configuration
code.
"""
