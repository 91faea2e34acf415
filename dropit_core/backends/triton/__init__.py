"""Triton kernels for the packs, each beside its launch wrapper, each writing exactly its eager
reference's bytes. Importing a submodule imports triton: only :mod:`..dispatch` does, when used.

- :mod:`.quant`: quant's pack and rebuild, one launch each.
- :mod:`.relu`: the ReLU writing its output and 1-bit mask, and its backward.
- :mod:`.compact`: the element-wise packs' compaction and rebuild.
- :mod:`.select`: the histogram passes of mink's radix select.
- :mod:`.launch`: a launch's grid and tile arithmetic, in plain Python.
- :mod:`.noise`: :func:`dropit_core.formats.seeds.hash_uniform` in Triton.
"""
