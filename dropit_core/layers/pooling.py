"""A max-pool that keeps one byte per output for backward (which element of its window won), not
its input and int64 indices: the backward rebuilds the indices for aten's own max-pool backward,
bit for bit the plain layer's gradient.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.utils import _pair

from dropit_core.formats.packed import refuse_double_backward


def _window_origins(out_shape, stride, padding, device: torch.device):
    """(the first input row each output row reads, as a column; the first column of each output
    column, as a row)."""
    oh, ow = out_shape[-2:]
    rows = torch.arange(oh, device=device).view(oh, 1) * stride[0] - padding[0]
    return rows, torch.arange(ow, device=device).view(1, ow) * stride[1] - padding[1]


class _MaxPoolFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation, ceil_mode):
        out, index = torch.ops.aten.max_pool2d_with_indices.default(
            x, kernel, stride, padding, dilation, ceil_mode
        )
        width = x.shape[-1]
        rows, cols = _window_origins(out.shape, stride, padding, x.device)
        # the winner's place in its window: (row step, column step) from the window's origin
        kh = torch.div(index // width - rows, dilation[0], rounding_mode="floor")
        kw = torch.div(index % width - cols, dilation[1], rounding_mode="floor")
        ctx.save_for_backward((kh * kernel[1] + kw).to(torch.uint8))
        ctx.args = (kernel, stride, padding, dilation, ceil_mode)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward()
        (local,) = ctx.saved_tensors
        kernel, stride, padding, dilation, ceil_mode = ctx.args
        width = ctx.x_shape[-1]
        rows, cols = _window_origins(local.shape, stride, padding, grad.device)
        local = local.long()
        kh, kw = local // kernel[1], local % kernel[1]
        index = (rows + kh * dilation[0]) * width + (cols + kw * dilation[1])
        # the backward reads only the input's shape (and dtype): a zero-stride stand-in
        shape_of_x = grad.new_zeros((), dtype=ctx.x_dtype).expand(ctx.x_shape)
        gx = torch.ops.aten.max_pool2d_with_indices_backward.default(
            grad.contiguous(), shape_of_x, kernel, stride, padding, dilation, ceil_mode, index
        )
        return gx, None, None, None, None, None


class DropITMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` that keeps one byte per output (the window's winner) for backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = _pair(self.kernel_size)
        if (
            self.return_indices
            or not (self.training and torch.is_grad_enabled() and x.requires_grad)
            or kernel[0] * kernel[1] > 256  # the winner no longer fits in a byte
        ):
            return super().forward(x)
        stride = _pair(self.stride if self.stride is not None else self.kernel_size)
        return _MaxPoolFunction.apply(
            x, kernel, stride, _pair(self.padding), _pair(self.dilation), self.ceil_mode
        )
