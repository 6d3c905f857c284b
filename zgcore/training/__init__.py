"""Training: the one training loop every stage runs on (:mod:`.loop`: optimizers, schedule,
clipping, non-finite checks, log, checkpoints, resume), the block objectives (:mod:`.objectives`),
ZeroGraph block training (:mod:`.blocks`), end-to-end distillation and healing (:mod:`.distill`),
the learning-rate search (:mod:`.lr_search`), live watching with TensorBoard (:mod:`.watch`) and
measured memory (:mod:`.memory`). May import the top-level utilities, :mod:`zgcore.models` and
:mod:`zgcore.data`; never evaluation or configuration code.
"""
