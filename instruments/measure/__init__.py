"""Measuring instruments, apart from the training product: step and per-op benchmarks, the
largest batch in a memory budget, gradient fidelity, and the accuracy study with its report.

Nothing in the product (config, data, models, engine, evaluation, checkpoint, report) imports
from here; these modules build on it.
"""
