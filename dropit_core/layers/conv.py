"""The DropIT convolution, plain and transposed (the parts the package names; the backward body
:func:`conv_grads`, chunked for a large input). The output and the input and bias gradients are
the plain op's; only the weight gradient reads the rebuilt input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dropit_core.layers import library
from dropit_core.layers.cache import (
    Grads,
    InputCache,
    Rebuilt,
    forward_and_pack,
    weight_and_input,
)
from dropit_core.layers.casts import WeightLayer


class ConvArgs(NamedTuple):
    """The arguments of ``aten.convolution`` besides input, weight and bias (lists or tuples)."""

    stride: Sequence[int]
    padding: Sequence[int]
    dilation: Sequence[int]
    transposed: bool
    output_padding: Sequence[int]
    groups: int


# Inputs of at least this many bytes have their conv's weight and input gradients made in turn
# (conv_grads): one rebuilt map fewer at the peak, for one more call.
SPLIT_BYTES = 8 << 20
# A split weight gradient's chunk of images: at most this many bytes of input (at least one
# image), by device type (docs/results/chunk_bytes/; the CPU's keeps the committed runs' sums).
CHUNK_BYTES: dict[str, int] = {"cpu": 8 << 20, "accelerator": 64 << 20}


def images_per_chunk(batch: int, image_bytes: int, device: torch.device) -> int:
    """Images of ``image_bytes`` a backward's chunk on ``device`` takes: 1 to ``batch``."""
    budget = CHUNK_BYTES["cpu" if device.type == "cpu" else "accelerator"]
    return max(1, min(batch, budget // max(image_bytes, 1)))


class DropITConvFunction(torch.autograd.Function):
    """Convolution (plain or transposed) whose weight gradient uses a dropped input cache."""

    @staticmethod
    def forward(ctx, x, weight, bias, cache: InputCache, dtype, args: ConvArgs):
        ctx.args = args
        return forward_and_pack(
            ctx, torch.convolution, "conv", x, weight, bias, cache, dtype, *args
        )

    @staticmethod
    def backward(ctx, grad):
        weight, rebuilt = weight_and_input(ctx)
        grads = conv_grads(grad, weight, ctx.x_shape, ctx.args, ctx.needs_input_grad, rebuilt)
        return grads + (None,) * 3


def conv_grads(
    grad: Tensor,
    weight: Tensor,
    x_shape: Sequence[int],
    args: ConvArgs,
    needs: Sequence[bool],
    rebuilt: Rebuilt | None,
) -> Grads:
    """(input, weight, bias gradients) of a DropIT conv; ``rebuilt`` reads the packed input (None:
    the weight does not train). A large input (SPLIT_BYTES) has them made in turn, bit for bit."""
    need_x, need_w, need_b = needs[:3]
    need_w = need_w and rebuilt is not None
    out_channels = weight.shape[1] * args.groups if args.transposed else weight.shape[0]
    grad = grad.contiguous()  # a no-op when it already is
    bias_sizes = [out_channels] if need_b else None
    if need_w and math.prod(x_shape) * grad.element_size() >= SPLIT_BYTES:
        gw, gb = _weight_grad_by_images(grad, rebuilt, x_shape, weight, bias_sizes, args)
        return (conv_input_grad(grad, weight, x_shape, args) if need_x else None), gw, gb
    if not need_w and not need_b:
        return (conv_input_grad(grad, weight, x_shape, args) if need_x else None), None, None
    x_hat = rebuilt.whole() if need_w else _zeros_like_shape(grad, x_shape)
    gx, gw, gb = torch.ops.aten.convolution_backward.default(
        grad, x_hat, weight, bias_sizes, *args, [need_x, need_w, need_b]
    )
    return gx, gw, gb


def _zeros_like_shape(ref: Tensor, shape: torch.Size) -> Tensor:
    # A zero-stride stand-in: the input gradient only reads the input's shape.
    return ref.new_zeros(()).expand(shape)


def conv_input_grad(grad: Tensor, weight: Tensor, x_shape: torch.Size, args: ConvArgs) -> Tensor:
    """A conv's input gradient without its input; on the CPU a 2-D conv's by the transposed conv
    of ``grad`` (the backward's kernel would make a whole map of zeros of the stand-in)."""
    if grad.device.type == "cpu" and not args.transposed and grad.dim() == 4:
        k = weight.shape[2:]
        pad = [
            x_shape[2 + i]
            - ((grad.shape[2 + i] - 1) * args.stride[i] - 2 * args.padding[i]
               + args.dilation[i] * (k[i] - 1) + 1)
            for i in range(2)
        ]  # fmt: skip
        # the rows and columns the forward's stride skipped at the end (what torch allows)
        if all(0 <= p < max(s, d) for p, s, d in zip(pad, args.stride, args.dilation, strict=True)):
            return F.conv_transpose2d(
                grad, weight, None, args.stride, args.padding, pad, args.groups, args.dilation
            )
    return torch.ops.aten.convolution_backward.default(
        grad, _zeros_like_shape(grad, x_shape), weight, None, *args, [True, False, False]
    )[0]


def _weight_grad_by_images(
    grad: Tensor,
    rebuilt: Rebuilt,
    x_shape: Sequence[int],
    weight: Tensor,
    bias_sizes: list[int] | None,
    args: ConvArgs,
) -> tuple[Tensor, Tensor | None]:
    """The weight (and bias) gradient of a conv as a sum over chunks of images (CHUNK_BYTES of
    input each), so that the rebuilt input is a chunk's, summed in fp32 in image order."""
    batch = x_shape[0]
    per_image = math.prod(x_shape[1:]) * grad.element_size()
    chunk = images_per_chunk(batch, per_image, grad.device)
    mask = [False, True, bias_sizes is not None]
    if chunk >= batch:
        _, gw, gb = torch.ops.aten.convolution_backward.default(
            grad, rebuilt.images(0, batch), weight, bias_sizes, *args, mask
        )
        return gw, gb
    gw = gb = None
    for i in range(0, batch, chunk):
        _, w_i, b_i = torch.ops.aten.convolution_backward.default(
            grad[i : i + chunk], rebuilt.images(i, min(i + chunk, batch)), weight, bias_sizes,
            *args,
            mask,
        )  # fmt: skip
        gw = w_i.float() if gw is None else gw.add_(w_i)
        if b_i is not None:
            gb = b_i.float() if gb is None else gb.add_(b_i)
    return gw.to(weight.dtype), (None if gb is None else gb.to(weight.dtype))


def _convolution(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    fields: list[Tensor],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
    cache: int,
) -> Tensor:
    """``torch.convolution`` (its own fake too); the weight gradient reads the pack ``fields``."""
    return torch.convolution(
        x, weight, bias, stride, padding, dilation, transposed, output_padding, groups
    )


library.layer_op(
    "conv",
    _convolution,
    lambda grad, weight, ctx, rebuilt: conv_grads(
        grad, weight, ctx.x_shape, ConvArgs(*ctx.args), ctx.needs_input_grad, rebuilt
    ),
)


def _traced(x, weight, bias, fields, cache: int, args: ConvArgs) -> Tensor:
    # the operator takes lists (a module's tuples, as eager aten takes them, are lists here)
    lists = [list(a) if isinstance(a, tuple) else a for a in args]
    return torch.ops.dropit.conv(x, weight, bias, fields, *lists, cache)


class DropITConv2d(WeightLayer, nn.Conv2d):
    """``nn.Conv2d`` whose weight gradient is computed from a dropped input cache."""

    def dropit_forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if x.dim() == 3:  # an unbatched (C, H, W) input, as nn.Conv2d takes
            return self.dropit_forward(x.unsqueeze(0), weight, bias).squeeze(0)
        padding = self.padding
        if self.padding_mode != "zeros" or padding == "same":  # the pads nn.Conv2d worked out
            mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
            x, padding = F.pad(x, self._reversed_padding_repeated_twice, mode=mode), (0, 0)
        elif padding == "valid":
            padding = (0, 0)
        # The module's tuples as they are (a list of each per call was host time)
        args = ConvArgs(self.stride, padding, self.dilation, False, (0, 0), self.groups)
        return library.run(
            DropITConvFunction, _traced, "conv", x, weight, bias, self.dropit_cache, args
        )


class DropITConvTranspose2d(WeightLayer, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` whose weight gradient is computed from a dropped input cache."""

    def dropit_forward(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, output_size: list[int] | None = None
    ) -> Tensor:
        if x.dim() == 3:  # an unbatched (C, H, W) input, as nn.ConvTranspose2d takes
            return self.dropit_forward(x.unsqueeze(0), weight, bias, output_size).squeeze(0)
        stride, padding, dilation = list(self.stride), list(self.padding), list(self.dilation)
        kernel = list(self.kernel_size)
        output_padding = self._output_padding(x, output_size, stride, padding, kernel, 2, dilation)
        args = ConvArgs(stride, padding, dilation, True, list(output_padding), self.groups)
        return library.run(
            DropITConvFunction, _traced, "conv", x, weight, bias, self.dropit_cache, args
        )
