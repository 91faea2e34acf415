"""The counter-based uniform draw in Triton: :func:`dropit_core.formats.seeds.hash_uniform`, bit for
bit."""

from __future__ import annotations

import triton
import triton.language as tl

from dropit_core.formats import seeds

# Module constants a kernel may read must be constexpr; tests check they equal seeds'.
MIX_MUL1: tl.constexpr = tl.constexpr(seeds.MIX_MUL1)
MIX_MUL2: tl.constexpr = tl.constexpr(seeds.MIX_MUL2)
TABLE_BITS: tl.constexpr = tl.constexpr(seeds.TABLE_BITS)
TABLE_MASK: tl.constexpr = tl.constexpr((1 << seeds.TABLE_BITS) - 1)
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
def uniform(key_low, key_high, index):
    """fp32 in [0, 1) for int64 element indices ``index`` (below 2**44) of a pack whose
    ``seeds.hash_keys`` are (key_low, key_high): seeds.hash_uniform's draw for each."""
    # Every sum is cast back to uint32 (wrapping, as the eager path's masked sums).
    low = ((index & TABLE_MASK).to(tl.uint32) + key_low.to(tl.uint32)).to(tl.uint32)
    high = ((index >> TABLE_BITS).to(tl.uint32) + key_high.to(tl.uint32)).to(tl.uint32)
    h = (mix32(low) >> UNIFORM_SHIFT) ^ (mix32(high) >> UNIFORM_SHIFT)
    return h.to(tl.float32) * UNIFORM_SCALE
