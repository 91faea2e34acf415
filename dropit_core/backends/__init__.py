"""How fast: the implementations of each pack besides the eager reference, and the choice.

- :mod:`.dispatch`: which implementation a pack runs (Triton on CUDA where it imports, the C loops
  on the CPU where they build, else eager), decided from the settings.
- :mod:`.native`: the CPU's C loops (``native.c``), built once with the system compiler.
- :mod:`.triton`: the CUDA kernels, one Triton launch per pack and per rebuild.
"""

from dropit_core.backends.dispatch import kernels, triton_available

__all__ = ["kernels", "triton_available"]
