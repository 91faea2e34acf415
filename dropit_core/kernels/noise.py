"""The counter-based uniform draw in Triton: :func:`dropit_core.seeds.hash_uniform`, bit for bit."""

from __future__ import annotations

import triton
import triton.language as tl

from .. import seeds

# Module constants a kernel may read must be constexpr; tests check they equal seeds'.
MIX_MUL1: tl.constexpr = tl.constexpr(seeds.MIX_MUL1)
MIX_MUL2: tl.constexpr = tl.constexpr(seeds.MIX_MUL2)
KEY_SALT: tl.constexpr = tl.constexpr(seeds.KEY_SALT)
UNIFORM_SHIFT: tl.constexpr = tl.constexpr(32 - seeds.UNIFORM_BITS)
UNIFORM_SCALE: tl.constexpr = tl.constexpr(2.0**-seeds.UNIFORM_BITS)


@triton.jit
def mix32(x):
    """seeds.mix32 on uint32 (the products wrap modulo 2**32, as the masked int64 ones do)."""
    x ^= x >> 16
    x *= MIX_MUL1
    x ^= x >> 15
    x *= MIX_MUL2
    x ^= x >> 15
    return x


@triton.jit
def uniform(seed_lo, seed_hi, index):
    """fp32 in [0, 1) for int64 element indices ``index`` of a pack seeded (seed_hi << 32) |
    seed_lo: seeds.hash_uniform's draw for each."""
    # Every sum is cast back to uint32: a constant above 2**31 would widen it to int64.
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    salted = (hi + KEY_SALT).to(tl.uint32)
    key = mix32(mix32(seed_hi.to(tl.uint32) ^ mix32(salted)) ^ seed_lo.to(tl.uint32))
    h = mix32((lo + key).to(tl.uint32))
    return (h >> UNIFORM_SHIFT).to(tl.float32) * UNIFORM_SCALE


def seed_words(seed: int) -> tuple[int, int]:
    """A pack seed (< 2**64) as the two 32-bit words the kernels take."""
    return seed & seeds.MASK32, (seed >> 32) & seeds.MASK32
