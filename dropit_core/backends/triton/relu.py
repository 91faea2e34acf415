"""The ReLU that keeps a 1-bit mask, forward and backward, one Triton launch each (reference:
``dropit_core.layers.relu.MaskedReLUFunction``, whose mask is ``formats.bits.pack_bits(out
<= 0)``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dropit_core.backends.dispatch import RELU_FLOATS
from dropit_core.backends.triton.launch import cdiv

RELU_BLOCK = 4096  # elements per program: a multiple of 8, so each program writes whole bytes
FLOATS = RELU_FLOATS  # the dtypes dispatch.choose gives these kernels


@triton.jit
def relu_mask_kernel(x_ptr, out_ptr, bits_ptr, n, BLOCK: tl.constexpr, KEEP_NEG_ZERO: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n
    x = tl.load(x_ptr + idx, mask=ok, other=0.0)
    blocked = x <= 0  # NaN is not blocked: it passes, as in torch.relu and its backward
    # torch.relu keeps -0.0 on the CPU and writes +0.0 for it on CUDA (seen on an H200): the
    # kernel writes what torch.relu writes on the tensor's device. NaN passes on both.
    if KEEP_NEG_ZERO:
        zeroed = x < 0
    else:
        zeroed = blocked
    tl.store(out_ptr + idx, tl.where(zeroed, 0.0, x).to(x.dtype), mask=ok)
    flags = tl.where(blocked & ok, 1, 0)  # past the end: zero flags, as pack_bits pads
    shifts = tl.arange(0, 8)
    byte = tl.sum(tl.reshape(flags, (BLOCK // 8, 8)) << shifts[None, :], axis=1)
    bidx = tl.program_id(0).to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    tl.store(bits_ptr + bidx, byte.to(tl.uint8), mask=bidx < (n + 7) // 8)


def relu_mask(
    x: torch.Tensor, inplace: bool = False, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(relu(x), the packed flags of ``relu(x) <= 0``) in one launch (``inplace``: into x,
    contiguous). ``check=False``: no argument checks (host time)."""
    if check and x.dtype not in FLOATS:
        raise ValueError(f"relu_mask takes a float tensor, got {x.dtype}")
    if check and inplace and not x.is_contiguous():
        raise ValueError("relu_mask(inplace=True) needs a contiguous tensor")
    src = x.contiguous()
    out = src if inplace else torch.empty_like(src)
    n = src.numel()
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    if n:
        relu_mask_kernel[(cdiv(n, RELU_BLOCK),)](
            src, out, bits, n, BLOCK=RELU_BLOCK, KEEP_NEG_ZERO=not x.is_cuda
        )
    return out, bits


@triton.jit
def relu_mask_grad_kernel(grad_ptr, bits_ptr, out_ptr, n, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n
    g = tl.load(grad_ptr + idx, mask=ok, other=0.0)
    byte = tl.load(bits_ptr + idx // 8, mask=ok, other=0).to(tl.int32)
    blocked = ((byte >> (idx % 8).to(tl.int32)) & 1) != 0
    tl.store(out_ptr + idx, tl.where(blocked, 0.0, g).to(g.dtype), mask=ok)


def relu_mask_grad(grad: torch.Tensor, bits: torch.Tensor, check: bool = True) -> torch.Tensor:
    """``grad`` with the flagged elements +0.0, as ``formats.bits.zero_flagged``, in one launch.
    ``check=False``: no argument checks (host time)."""
    if check and (grad.dtype not in FLOATS or bits.dtype != torch.uint8):
        raise ValueError("relu_mask_grad takes a float gradient and uint8 mask bytes")
    if check and bits.numel() != (grad.numel() + 7) // 8:
        raise ValueError(f"relu_mask_grad: {bits.numel()} mask bytes for {grad.numel()} values")
    g = grad.contiguous()
    out = torch.empty_like(g)
    n = g.numel()
    if n:
        relu_mask_grad_kernel[(cdiv(n, RELU_BLOCK),)](g, bits, out, n, BLOCK=RELU_BLOCK)
    return out
