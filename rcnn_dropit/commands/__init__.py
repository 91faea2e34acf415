"""The command-line tools, one module each with a ``main(argv) -> int``: installed as console
scripts (``dropit-train``, ``dropit-test``, ...; see pyproject.toml) and wrapped by ``tools/*.py``
for work from a checkout."""
