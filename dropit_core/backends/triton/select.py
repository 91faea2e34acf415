"""The histogram passes of mink's radix select in Triton, one launch each (reference: the slice
loop of ``dropit_core.strategies.select.radix_kth_largest_abs``, the same counters). The zeros
are summed per program first, not piled onto one counter by atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dropit_core.backends.triton.launch import cdiv

BLOCK = 4096
_INT = {torch.float32: tl.int32, torch.float16: tl.int16, torch.bfloat16: tl.int16}


@triton.jit
def _hist_kernel(
    x_ptr, hist_ptr, prefix_ptr, n,
    WIDE: tl.constexpr, SHIFT: tl.constexpr, SECOND: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n
    x = tl.load(x_ptr + idx, mask=ok, other=0.0)
    if WIDE:  # the bit pattern of |x|: the sign bit cleared
        b = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    else:
        b = x.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF
    bucket = (b >> SHIFT) & 0xFFFF
    if SECOND:  # only the chosen bucket's elements, by their low 16 bits
        count = ok & ((b >> 16) == tl.load(prefix_ptr))
    else:
        count = ok & (bucket != 0)
        zeros = tl.sum((ok & (bucket == 0)).to(tl.int32), axis=0)
        tl.atomic_add(hist_ptr, zeros)
    tl.atomic_add(hist_ptr + bucket, tl.full(bucket.shape, 1, tl.int32), mask=count)


def abs_bits_histogram(
    flat: torch.Tensor, shift: int, prefix: torch.Tensor | None = None, block: int = BLOCK
) -> torch.Tensor:
    """65536 int32 counters of ``(bits(|flat|) >> shift) & 0xFFFF``; with ``prefix`` (the second
    pass of a 32-bit float, a 1-element int32 tensor), only of the elements whose high 16 bits
    equal it. ``flat``: a flat fp32, fp16 or bf16 tensor."""
    if flat.dim() != 1 or flat.dtype not in _INT:
        raise ValueError(f"abs_bits_histogram takes a flat fp32/fp16/bf16 tensor, got {flat.dtype}")
    flat = flat.contiguous()
    hist = torch.zeros(1 << 16, dtype=torch.int32, device=flat.device)
    n = flat.numel()
    if n == 0:
        return hist
    second = prefix is not None
    _hist_kernel[(cdiv(n, block),)](
        flat, hist, prefix if second else hist, n,
        WIDE=flat.element_size() == 4, SHIFT=shift, SECOND=second, BLOCK=block,
    )  # fmt: skip
    return hist
