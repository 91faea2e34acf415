"""The instruments' command-line tools, one module each with a ``main(argv) -> int``, run from a
checkout through the scripts of the same names under ``tools/``."""
