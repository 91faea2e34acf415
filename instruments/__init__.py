"""The measuring instruments of rcnn-dropit, kept apart from the product as torchvision keeps
``references/`` beside ``torchvision/``: the benchmarks (step, per-op, largest batch, host,
pooler, fusion), gradient fidelity, and the accuracy study with its report.

Not installed: they run from a checkout (``python tools/bench.py``, ``tools/study.py``, ...),
and read and write the checkout's configs and docs. They build on ``rcnn_dropit`` and
``dropit_core``; nothing in either imports from here.
"""
