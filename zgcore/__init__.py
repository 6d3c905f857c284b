"""ZeroGraph core library: teacher adapters, corpus and boundary stores, objectives, training,
assembly and metrics. Plain functions and classes; this package never imports Luigi."""

__version__ = "0.1.0"
