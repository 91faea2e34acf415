"""The measuring instruments of rcnn-dropit, kept apart from the product as torchvision keeps
``references/`` beside ``torchvision/``: the benchmarks (step, largest batch, host, fusion,
the live tensors at a peak), the GPU lease's checks, gradient fidelity, and the accuracy study
with its report.

Not installed: they run from a checkout (``python tools/bench.py``, ``tools/study.py``, ...),
and read and write the checkout's configs and docs. They build on ``rcnn_dropit`` and
``dropit_core``; nothing in either imports from here.

An instrument stays while a results page, a make target or ``tools/gpu_session.sh`` reads what
it writes; a one-off probe goes once a committed result answers its question, and the page that
quotes it names the commit that still has it (issue 68).
"""
