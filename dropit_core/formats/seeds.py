"""Seeds for reproducible random packs: one integer hash of (strategy seed, step, pack, ...).

A strategy that draws seeds each pack from its ``seed`` option and a key that
:class:`dropit_core.layers.cache.InputCache` derives from the step and the pack's position in
that step's forward: no generator state to save, nothing read from a device. :func:`hash_uniform`
is the counter-based draw, a pure function of (seed, element index), the same numbers in eager
torch, the C loops and Triton, whatever the slice or block an element falls in.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _signed64(c: int) -> int:
    """A 64-bit pattern as the int64 torch holds it."""
    return c - (1 << 64) if c >> 63 else c


# SplitMix64's constants as int64 patterns: a Python int masked to 64 bits after each step and
# an int64 tensor (whose arithmetic wraps) then hold the same bits.
_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MUL1 = _signed64(0xBF58476D1CE4E5B9)
_MUL2 = _signed64(0x94D049BB133111EB)


def _splitmix64(z: int | torch.Tensor, wrap: int = _MASK64) -> int | torch.Tensor:
    """One step of SplitMix64 (Steele, Lea and Flood 2014) of a Python int in [0, 2**64) or, with
    ``wrap=-1``, of each element of an int64 tensor of such patterns (shifts logical on both)."""
    z = (z + _GOLDEN) & wrap
    z = ((z ^ (z >> 30 & (1 << 34) - 1)) * _MUL1) & wrap
    z = ((z ^ (z >> 27 & (1 << 37) - 1)) * _MUL2) & wrap
    return z ^ (z >> 31 & (1 << 33) - 1)


def mix_seed(*parts: int) -> int:
    """A seed in [0, 2**62) that depends on every part and on their order (below 2**62: plus a
    slice offset, it still fits ``torch.Generator.manual_seed``)."""
    return seed_of(mix_state(0, *parts))


def mix_part(state: int, part: int | torch.Tensor) -> int | torch.Tensor:
    """``mix_state(state, part)`` of one part, without the loop (host time); of each element of
    an int64 tensor of parts, as an int64 tensor of the states' bit patterns."""
    if isinstance(part, torch.Tensor):
        return _splitmix64(part ^ _signed64(state), -1)
    return _splitmix64(state ^ part)


def seed_of(state: int | torch.Tensor) -> int | torch.Tensor:
    """The seed in [0, 2**62) of a 64-bit state (``mix_seed``'s last step), of an int or tensor."""
    return state >> 2 & (1 << 62) - 1


def mix_state(state: int, *parts: int) -> int:
    """The 64-bit state :func:`mix_seed` folds its parts into, from ``state`` on:
    ``mix_seed(a, b, c) == mix_state(mix_state(0, a, b), c) >> 2`` (a prefix folded once)."""
    for part in parts:
        state = _splitmix64(state ^ (part & _MASK64))
    return state


# The 32-bit mixer: two xorshift-multiply rounds (hash-prospector's best two-round constants).
# Both multipliers are below 2**31, so a 32-bit value times one stays below 2**63: torch's int64
# arithmetic never overflows, and masking to 32 bits gives the uint32 product Triton computes.
MIX_MUL1 = 0x21F0AAAD
MIX_MUL2 = 0x735A2D97
MASK32 = 0xFFFFFFFF
KEY_SALT = 0x9E3779B9  # keeps the key of index word 0 away from mix32(0) == 0
UNIFORM_BITS = 24  # a 24-bit integer times 2**-24: exact in fp32, in [0, 1)
TABLE_BITS = 12  # the draw XORs a hash of the index's low 12 bits with one of the rest


def mix32(x: int | torch.Tensor) -> int | torch.Tensor:
    """The 32-bit mixer, a bijection of [0, 2**32), on a Python int or, in place, on an int64
    tensor of such values: the Python form of native.c's and triton/noise.py's."""
    x ^= x >> 16
    x *= MIX_MUL1
    x &= MASK32
    x ^= x >> 15
    x *= MIX_MUL2
    x &= MASK32
    x ^= x >> 15
    return x


def hash_keys(seed: int) -> tuple[int, int]:
    """The two 32-bit keys (k0, k1) of a pack seed's draws, which every path that hashes element
    indices takes: ``k_j = mix32(mix32(hi ^ mix32(j + KEY_SALT)) ^ lo)``, ``lo`` and ``hi`` the
    seed's low and high 32 bits (the salted words mixed once, at import)."""
    lo, hi = seed & MASK32, (seed >> 32) & MASK32
    return mix32(mix32(hi ^ _SALTED_0) ^ lo), mix32(mix32(hi ^ _SALTED_1) ^ lo)


_SALTED_0, _SALTED_1 = mix32(KEY_SALT), mix32(1 + KEY_SALT)


def _table(key: int | torch.Tensor, first: int, count: int, device: torch.device) -> torch.Tensor:
    """``mix32((first + j + key) mod 2**32) >> 8`` for j < count, as int32; ``key`` an int or a
    0-dim int64 tensor (a traced pack's keys are device data)."""
    x = torch.arange(first, first + count, dtype=torch.int64, device=device).add_(key)
    return (mix32(x.bitwise_and_(MASK32)) >> (32 - UNIFORM_BITS)).to(torch.int32)


def hash_bits(seed: int, start: int, length: int, device: torch.device) -> torch.Tensor:
    """The 24-bit integers (int32) behind :func:`hash_uniform`: element i of a pack seeded
    ``seed`` draws ``(mix32(i mod 4096 + k0) ^ mix32(i >> 12 + k1)) >> 8`` (sums modulo 2**32;
    k0, k1 = hash_keys(seed)), for i below 2**44. Here two small tables and one broadcast XOR:
    one pass over the output, where hashing every index would take a dozen."""
    return keyed_bits(hash_keys(seed), start, length, device)


def keyed_bits(
    keys: tuple[int, int] | tuple[torch.Tensor, torch.Tensor],
    start: int,
    length: int,
    device: torch.device,
) -> torch.Tensor:
    """:func:`hash_bits` from ``hash_keys(seed)``, ints or 0-dim int64 tensors (keys read from
    device memory: a CUDA graph's, a traced pack's)."""
    if start + length > 1 << 44:
        raise ValueError("hash_bits draws for element indices below 2**44")
    key_low, key_high = keys
    first_row = start >> TABLE_BITS
    rows = ((start + length - 1) >> TABLE_BITS) + 1 - first_row if length else 0
    offset = start - (first_row << TABLE_BITS)
    high = _table(key_high, first_row, rows, device)
    if rows <= 1:  # within one row (a group's tail, say): the low entries it needs, no more
        return _table(key_low, offset, length, device) ^ high
    low = _table(key_low, 0, 1 << TABLE_BITS, device)
    return (high[:, None] ^ low[None, :]).view(-1)[offset : offset + length]


def hash_uniform(seed: int, start: int, length: int, device: torch.device) -> torch.Tensor:
    """``length`` fp32 numbers uniform in [0, 1) for flat elements ``start`` onward of a pack
    seeded ``seed``: :func:`hash_bits` times 2**-24 (exact in fp32)."""
    return hash_bits(seed, start, length, device).float().mul_(2.0**-UNIFORM_BITS)
