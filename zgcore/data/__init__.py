"""Data: corpus sources and their documents (:mod:`.sources`), the tokenised corpus and its split
(:mod:`.corpus`), out-of-domain held-out text (:mod:`.heldout`), the deterministic data order
(:mod:`.order`), the sharded, checksummed boundary store of the teacher's residual stream
(:mod:`.boundary_store`) and the prefetching input pipeline that reads it (:mod:`.feed`). May import
the top-level utilities and :mod:`zgcore.models` (writing the store runs the teacher); never
training, evaluation or configuration code.
"""
