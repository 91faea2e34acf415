"""Seeds for reproducible random packs: one integer hash of (strategy seed, step, pack, ...).

A strategy that draws (random keeps, importance sampling, stochastic rounding) seeds each pack
from its ``seed`` option and a key that :class:`dropit_core.ops.InputCache` derives from the
training step and the pack's position in that step's forward. Plain Python integers: no
generator state to save in a checkpoint, nothing read from a device.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    """One step of SplitMix64 (Steele, Lea and Flood 2014): a bijective 64-bit mixer."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix_seed(*parts: int) -> int:
    """A seed in [0, 2**62) that depends on every part and on their order.

    Below 2**62 so that a slice offset (a few billion at most) can be added and the sum still
    fits ``torch.Generator.manual_seed``.
    """
    h = 0
    for part in parts:
        h = _splitmix64(h ^ (part & _MASK64))
    return h >> 2


def uniform(seed: int, start: int, length: int, device: torch.device) -> torch.Tensor:
    """``length`` fp32 numbers uniform in [0, 1): the draws for flat elements ``start`` onward of
    a pack seeded ``seed``, from a generator on ``device`` (nothing crosses to the host)."""
    gen = torch.Generator(device=device).manual_seed(seed + start)
    return torch.rand(length, generator=gen, device=device)
