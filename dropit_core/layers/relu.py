"""The ReLU that keeps a 1-bit mask of its output instead of the output, and its forward and
backward bodies, which run the mask through the Triton kernels, the C loops or eager torch as
:func:`dropit_core.backends.dispatch.choose` says (eager and traced alike).
"""

from __future__ import annotations

import torch

from dropit_core.backends import dispatch, native
from dropit_core.formats.bits import pack_blocked, zero_flagged_sliced
from dropit_core.formats.packed import refuse_double_backward


class MaskedReLUFunction(torch.autograd.Function):
    """ReLU that keeps one bit per element (output <= 0) for backward instead of the output.

    Storing "blocked" rather than "passes" lets NaN through exactly as the plain ReLU backward.
    """

    @staticmethod
    def forward(ctx, x, inplace: bool):
        out, bits = relu_and_mask(x, inplace)
        if inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(bits)
        return out

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward()
        (bits,) = ctx.saved_tensors
        return relu_mask_grad(grad, bits), None


def relu_and_mask(x: torch.Tensor, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(relu(x), the packed flags of ``relu(x) <= 0``): the masked ReLU's forward, eager and
    traced alike. The kernel takes a float tensor, contiguous when in place (it writes the
    output in x's memory order)."""
    way = dispatch.choose("relu_mask", x)
    if way == "triton" and (x.is_contiguous() or not inplace):
        return dispatch.kernels("relu").relu_mask(x, inplace, check=False)  # choose checked x
    out = x.relu_() if inplace else torch.relu(x)
    return out, native.relu_mask(out) if way == "native" else pack_blocked(out)


def relu_mask_grad(grad: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """The masked ReLU's input gradient: ``grad`` with the flagged elements zeroed."""
    way = dispatch.choose("relu_grad", grad)
    if way == "triton":
        return dispatch.kernels("relu").relu_mask_grad(grad, bits, check=False)
    return native.relu_apply(grad, bits) if way == "native" else zero_flagged_sliced(grad, bits)
