"""The instruments' command-line tools, one module each with a ``main(argv) -> int``, run from a
checkout through ``tools/bench.py``, ``tools/study.py``, ``tools/grad_figure.py`` and
``tools/grad_groups.py``."""
