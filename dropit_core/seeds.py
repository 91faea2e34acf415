"""Seeds for reproducible random packs: one integer hash of (strategy seed, step, pack, ...).

A strategy that draws (random keeps, importance sampling, stochastic rounding) seeds each pack
from its ``seed`` option and a key that :class:`dropit_core.ops.InputCache` derives from the
training step and the pack's position in that step's forward. Plain Python integers: no
generator state to save in a checkpoint, nothing read from a device.

:func:`hash_uniform` is the counter-based draw: a pure function of (seed, element index), the
same numbers in eager torch (int64 arithmetic here) and in Triton (uint32, in
:mod:`dropit_core.kernels`), whatever the slice or block an element falls in.
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


# The 32-bit mixer: two xorshift-multiply rounds (hash-prospector's best two-round constants).
# Both multipliers are below 2**31, so a 32-bit value times one stays below 2**63: torch's int64
# arithmetic never overflows, and masking to 32 bits gives the uint32 product Triton computes.
MIX_MUL1 = 0x21F0AAAD
MIX_MUL2 = 0x735A2D97
MASK32 = 0xFFFFFFFF
KEY_SALT = 0x9E3779B9  # keeps the key of index word 0 away from mix32(0) == 0
UNIFORM_BITS = 24  # a 24-bit integer times 2**-24: exact in fp32, in [0, 1)


def mix32(x: int) -> int:
    """The 32-bit mixer on a Python int (a bijection of [0, 2**32))."""
    x ^= x >> 16
    x = (x * MIX_MUL1) & MASK32
    x ^= x >> 15
    x = (x * MIX_MUL2) & MASK32
    return x ^ (x >> 15)


def hash_key(seed: int, index_hi: int) -> int:
    """The 32-bit key of a seed's draws for elements ``index_hi * 2**32`` onward."""
    lo, hi = seed & MASK32, (seed >> 32) & MASK32
    return mix32(mix32(hi ^ mix32((index_hi + KEY_SALT) & MASK32)) ^ lo)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` in place on an int64 tensor of values in [0, 2**32)."""
    x ^= x >> 16
    x.mul_(MIX_MUL1).bitwise_and_(MASK32)
    x ^= x >> 15
    x.mul_(MIX_MUL2).bitwise_and_(MASK32)
    x ^= x >> 15
    return x


def hash_uniform(seed: int, start: int, length: int, device: torch.device) -> torch.Tensor:
    """``length`` fp32 numbers uniform in [0, 1) for flat elements ``start`` onward of a pack
    seeded ``seed``: element i draws ``mix32((i mod 2**32 + hash_key(seed, i >> 32)) mod 2**32)
    >> 8`` times 2**-24, a pure function of (seed, i) that the Triton kernels compute alike."""
    out = torch.empty(length, dtype=torch.float32, device=device)
    end = start + length
    while start < end:  # one run per 2**32 block of indices (one run in practice)
        hi = start >> 32
        stop = min(end, (hi + 1) << 32)
        base = (start & MASK32) + hash_key(seed, hi)
        x = torch.arange(base, base + stop - start, dtype=torch.int64, device=device)
        x = _mix32_(x.bitwise_and_(MASK32))
        x >>= 32 - UNIFORM_BITS
        out[length - (end - start) : length - (end - stop)] = x
        start = stop
    return out.mul_(2.0**-UNIFORM_BITS)


def uniform(seed: int, start: int, length: int, device: torch.device) -> torch.Tensor:
    """``length`` fp32 numbers uniform in [0, 1): the draws for flat elements ``start`` onward of
    a pack seeded ``seed``, from a generator on ``device`` (nothing crosses to the host)."""
    gen = torch.Generator(device=device).manual_seed(seed + start)
    return torch.rand(length, generator=gen, device=device)
