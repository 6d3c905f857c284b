"""Models: the frozen teacher and the student built from it — resolving, fetching and loading a
teacher (:mod:`.teacher`), loading only the layers a task needs (:mod:`.teacher_weights`), one
adapter per decoder family and its quirks (:mod:`.families`), boundary capture, student blocks and
assembly into one causal LM (:mod:`.adapters`), MLP channel pruning (:mod:`.channels`), layer
influence (:mod:`.students`) and the arithmetic of a student's shape (:mod:`.shapes`). May import the
top-level utilities of :mod:`zgcore` only: no data, training, evaluation or configuration code.
"""
