"""Benchmarks of the cache economics and memory claims (``bench/run_all.py``; see ``bench/README.md``)."""
