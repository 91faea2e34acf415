"""The ReLU that keeps a 1-bit mask of its output instead of the output: its module, its autograd
Function, the forward and backward bodies, its traced operators, or under ``DROPIT_FUSE`` plain
torch ops.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dropit_core.backends import dispatch, native
from dropit_core.formats.bits import pack_bits, pack_blocked, zero_flagged_sliced
from dropit_core.formats.packed import refuse_double_backward


class MaskedReLUFunction(torch.autograd.Function):
    """ReLU that keeps one bit per element, output <= 0 ("blocked", so that NaN passes as in
    the plain backward), for backward instead of the output."""

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


def relu_and_mask(x: Tensor, inplace: bool) -> tuple[Tensor, Tensor]:
    """(relu(x), the packed flags of ``relu(x) <= 0``): the masked ReLU's forward, eager and
    traced alike. In place, the kernel writes the output in x's memory order: contiguous only."""
    allowed = ("native",) if inplace and not x.is_contiguous() else dispatch.FAST
    way = dispatch.choose("relu_mask", x, allowed)
    if way == "triton":
        return dispatch.kernels("relu").relu_mask(x, inplace, check=False)  # choose checked x
    out = x.relu_() if inplace else torch.relu(x)
    return out, native.relu_mask(out) if way == "native" else pack_blocked(out)


def relu_mask_grad(grad: Tensor, bits: Tensor) -> Tensor:
    """The masked ReLU's input gradient: ``grad`` with the flagged elements zeroed."""
    way = dispatch.choose("relu_grad", grad)
    if way == "triton":
        return dispatch.kernels("relu").relu_mask_grad(grad, bits, check=False)
    return native.relu_apply(grad, bits) if way == "native" else zero_flagged_sliced(grad, bits)


@torch.library.custom_op("dropit::relu_mask", mutates_args=())
def relu_mask_op(x: Tensor) -> tuple[Tensor, Tensor]:
    return relu_and_mask(x, False)


@relu_mask_op.register_fake
def _(x: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty(((x.numel() + 7) // 8,), dtype=torch.uint8)


relu_grad_op = torch.library.custom_op("dropit::relu_mask_grad", relu_mask_grad, mutates_args=())
relu_grad_op.register_fake(lambda grad, bits: torch.empty_like(grad))


def _relu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1])


def _relu_backward(ctx, grad, _bits_grad):
    return torch.ops.dropit.relu_mask_grad(grad, *ctx.saved_tensors)  # the mask's bits


relu_mask_op.register_autograd(_relu_backward, setup_context=_relu_setup)


class _MaskedReLU(torch.autograd.Function):
    """The masked ReLU in torch ops that Dynamo traces (eager's bytes: ``pack_bits``)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        out = torch.relu(x)
        ctx.save_for_backward(pack_bits((out <= 0).reshape(-1)))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (bits,) = ctx.saved_tensors
        shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
        flags = ((bits[:, None] >> shifts) & 1).reshape(-1)[: grad.numel()]
        return torch.where(flags.view(grad.shape).bool(), 0.0, grad)


class DropITReLU(nn.ReLU):
    """``nn.ReLU`` that keeps a 1-bit mask of its output for backward, not the output."""

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and torch.is_grad_enabled() and x.requires_grad):
            return super().forward(x)
        if torch.compiler.is_compiling():  # _MaskedReLU (fused) or the opaque op; in place: a copy
            out = _MaskedReLU.apply(x) if dispatch.fused() else torch.ops.dropit.relu_mask(x)[0]
            return x.copy_(out) if self.inplace else out
        return MaskedReLUFunction.apply(x, self.inplace)
