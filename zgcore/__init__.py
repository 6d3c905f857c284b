"""ZeroGraph core library: compositional blockwise training of language models via materialised
boundary supervision (arXiv:2611.02200), and greedy local learning (arXiv:2610.04867). Plain
functions and classes; this package never imports Luigi (``tasks/`` and ``workflows/`` do).

Its subpackages are layers, each importing only the layers listed before it (``tests/test_layout.py``
checks this)::

    atomic, hashing, checks, markdown, device, threads, progress   small shared utilities (import no subpackage)
    models      teachers, decoder families, partial loading, student blocks and shapes, assembly
    data        corpus sources, tokenised corpus, held-out text, data order, boundary store, input pipeline
    training    the one training loop, objectives, block training, distillation, lr search, watching
    evaluation  metrics, comparisons, reports, studies, plots
    config      experiment files, defaults, overrides, validation against the registries below
    local       greedy local learning (its own configuration, model, training and report)
"""

__version__ = "0.1.0"
