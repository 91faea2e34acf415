"""Triton kernels for the packs (torch and triton only), each beside its launch wrapper.

- :mod:`.quant`: the quant pack (group minimum and step, stochastic rounding, codes packed into
  bytes) in one launch, and its rebuild in one launch.
- :mod:`.relu`: the ReLU that writes its output and its 1-bit mask in one launch, and the
  backward that reads the mask.
- :mod:`.compact`: the element-wise packs (mink, threshold, importance, random) compacted and
  rebuilt, a count, a device-side cumulative sum and a write per tensor.
- :mod:`.select`: the histogram passes of mink's radix select, one launch each.
- :mod:`.launch`: a launch's grid and tile arithmetic, in plain Python.
- :mod:`.noise`: the counter-based uniform draw, :func:`dropit_core.formats.seeds.hash_uniform` in
  Triton.

Importing a submodule imports triton; :mod:`dropit_core.backends.dispatch` decides whether to (only
then), so ``dropit_core`` imports without triton. Every kernel writes exactly the format its eager
reference writes (``dropit_core.strategies.quant.Quant``,
``dropit_core.layers.relu.MaskedReLUFunction``, the fixed-capacity path of
``dropit_core.strategies.elementwise``, ``dropit_core.strategies.select``' radix select).
"""
