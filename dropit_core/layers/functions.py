"""Autograd functions: convolution and linear layers that keep a dropped input, with the chunked
backward that rebuilds it (its bodies, :func:`conv_grads` and :func:`linear_grads`, are the traced
operators' too).

The forward output is exactly the plain op's. The input gradient needs only the weight, and the
bias gradient only the output gradient, so both are exact; only the weight gradient is computed
from the rebuilt (dropped) input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dropit_core.formats.packed import Packed, refuse_double_backward, tag_pack
from dropit_core.layers.cache import InputCache


class ConvArgs(NamedTuple):
    """The arguments of ``aten.convolution`` besides input, weight and bias (lists or tuples:
    aten takes either; the compiled path's operators take lists)."""

    stride: Sequence[int]
    padding: Sequence[int]
    dilation: Sequence[int]
    transposed: bool
    output_padding: Sequence[int]
    groups: int


def _zeros_like_shape(ref: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    # A zero-stride stand-in: the input gradient only reads the input's shape.
    return ref.new_zeros(()).expand(shape)


def _forward_and_save(ctx, x, weight, bias, cache: InputCache, dtype, args: ConvArgs | None):
    """The conv (``args`` given) or linear op of ``x`` (cast to ``dtype``, autocast's; None:
    as it is), keeping for backward the weight (input gradient) and, when the weight trains, the
    pack of the input the op computed with: its tensor fields through ``save_for_backward``
    (None included), its metadata on ``ctx``.

    Where the strategy packs ``x`` as the cast's values directly (quant), ``x`` is packed and
    the cast's last reference goes before the pack, so the cast lives as long as the op, as
    plain autocast's copy does. The pack is keyed by ``x``: the layers fed ``x`` share it.
    """
    used = x if dtype is None else x.to(dtype)
    if args is None:
        out = F.linear(used, weight, bias)
    else:
        out = torch.convolution(used, weight, bias, *args)
    ctx.cache, ctx.x_shape = cache, x.shape
    if not weight.requires_grad:
        ctx.meta = None
        ctx.save_for_backward(weight)
        return out
    if used is not x and cache.reads_through_cast():
        used = x
    packed = cache.pack(used, "linear" if args is None else "conv", x, dtype or used.dtype)
    tag_pack(packed)  # before compress_saved's hooks, if any, see its tensors
    ctx.meta = packed.meta
    ctx.save_for_backward(weight, *packed[1:])
    return out


def _saved_input(ctx) -> tuple[torch.Tensor, Rebuilt | None]:
    """(weight, the packed input to rebuild or None) from what :func:`_forward_and_save` kept,
    for a backward: one that would be differentiated again is refused, and the forward is
    over."""
    refuse_double_backward()
    ctx.cache.end_forward()
    weight, *tensors = ctx.saved_tensors
    if ctx.meta is None:
        return weight, None
    return weight, Rebuilt(ctx.x_shape, ctx.cache, Packed(ctx.meta, *tensors))


# Inputs of at least this many bytes have their conv's weight and input gradients made in turn
# (conv_grads): one rebuilt map fewer at the peak, for one more call, which small layers skip.
SPLIT_BYTES = 8 << 20
# A split weight gradient takes its images in chunks of at least one image and at most this many
# bytes of input, by device type: 64 MiB on an accelerator, so a layer's launches do not grow with
# the batch while a chunk's rebuilt map stays small beside the peak (docs/results/chunk_bytes/);
# 8 MiB on the CPU, where a call costs only its work, so the committed CPU runs keep their sums.
CHUNK_BYTES: dict[str, int] = {"cpu": 8 << 20, "accelerator": 64 << 20}


def images_per_chunk(batch: int, image_bytes: int, device: torch.device) -> int:
    """How many images of ``image_bytes`` each a backward's chunk takes on ``device``: as many
    as its CHUNK_BYTES holds, at least one, at most the batch."""
    budget = CHUNK_BYTES["cpu" if device.type == "cpu" else "accelerator"]
    return max(1, min(batch, budget // max(image_bytes, 1)))


class DropITConvFunction(torch.autograd.Function):
    """Convolution (plain or transposed) whose weight gradient uses a dropped input cache."""

    @staticmethod
    def forward(ctx, x, weight, bias, args: ConvArgs, cache: InputCache, dtype):
        ctx.args = args
        return _forward_and_save(ctx, x, weight, bias, cache, dtype, args)

    @staticmethod
    def backward(ctx, grad):
        weight, rebuilt = _saved_input(ctx)
        grads = conv_grads(grad, weight, ctx.x_shape, ctx.args, ctx.needs_input_grad, rebuilt)
        return grads + (None,) * 3


Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def conv_grads(
    grad: torch.Tensor,
    weight: torch.Tensor,
    x_shape: Sequence[int],
    args: ConvArgs,
    needs: Sequence[bool],
    rebuilt: Rebuilt | None,
) -> Grads:
    """(input, weight, bias gradients) of a DropIT conv, the one body of the autograd Function's
    backward and the traced operator's. ``rebuilt`` reads the packed input (None: no pack, the
    weight does not train); ``needs`` the first three of ``ctx.needs_input_grad``.

    A large input (at least SPLIT_BYTES) has its gradients made in turn: the weight's (and
    bias's) first, over chunks of images (:func:`_weight_grad_by_images`), then the input
    gradient, bit for bit the joint call's: one map fewer alive at the backward's peak."""
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


def conv_input_grad(
    grad: torch.Tensor, weight: torch.Tensor, x_shape: torch.Size, args: ConvArgs
) -> torch.Tensor:
    """A conv's input gradient without its input. On the CPU a 2-D conv's is the transposed
    conv of ``grad``: the backward's kernel would first make its input argument contiguous (a
    whole map of zeros for the zero-stride stand-in); the same values."""
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


class Rebuilt:
    """A layer's packed input (of ``shape``), read back for its backward by its cache: whole, or
    images ``[i, j)`` at a time, each chunk rebuilt alone where the strategy can, else sliced
    from one rebuild of the whole batch (made once). The same values either way. (Slots: one is
    made in every backward.)"""

    __slots__ = ("shape", "cache", "packed", "_batch")

    def __init__(
        self, shape: Sequence[int], cache: InputCache | int, packed: Packed | list[torch.Tensor]
    ) -> None:
        self.shape, self.cache, self.packed = shape, cache, packed
        self._batch: torch.Tensor | None = None

    def read_whole(self) -> torch.Tensor:
        """One rebuild of the whole input."""
        return self.cache.unpack(self.packed)

    def read_part(self, start: int, stop: int) -> torch.Tensor | None:
        """Flat elements ``[start, stop)`` rebuilt alone, or None where the pack cannot."""
        return self.cache.unpack_part(self.packed, start, stop)

    def whole(self) -> torch.Tensor:
        """The whole rebuilt input."""
        return self.read_whole() if self._batch is None else self._batch

    def images(self, i: int, j: int) -> torch.Tensor:
        """Images ``[i, j)`` of the rebuilt input."""
        if self._batch is None:
            per_image = math.prod(self.shape[1:])
            part = self.read_part(i * per_image, j * per_image)
            if part is not None:
                return part.view(j - i, *self.shape[1:])
            self._batch = self.read_whole()
        return self._batch[i:j]


def _weight_grad_by_images(
    grad: torch.Tensor,
    rebuilt: Rebuilt,
    x_shape: Sequence[int],
    weight: torch.Tensor,
    bias_sizes: list[int] | None,
    args: ConvArgs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight (and bias) gradient of a conv as a sum over chunks of images (CHUNK_BYTES of
    input each, at least one image), images ``[i, j)`` read as ``rebuilt.images(i, j)``: the
    rebuilt input and the kernel's copies are a chunk's, not the batch's. The parts are summed
    in fp32 in image order: one call's value up to float rounding where there are several."""
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


class DropITLinearFunction(torch.autograd.Function):
    """Linear layer over any leading dims whose weight gradient uses a dropped input cache."""

    @staticmethod
    def forward(ctx, x, weight, bias, cache: InputCache, dtype):
        return _forward_and_save(ctx, x, weight, bias, cache, dtype, None)

    @staticmethod
    def backward(ctx, grad):
        weight, rebuilt = _saved_input(ctx)
        return linear_grads(grad, weight, ctx.x_shape, ctx.needs_input_grad, rebuilt) + (None,) * 2


def linear_grads(
    grad: torch.Tensor,
    weight: torch.Tensor,
    x_shape: Sequence[int],
    needs: Sequence[bool],
    rebuilt: Rebuilt | None,
) -> Grads:
    """(input, weight, bias gradients) of a DropIT linear layer over any leading dims: the one
    body of the autograd Function's backward and the traced operator's (as :func:`conv_grads`)."""
    need_x, need_w, need_b = needs[:3]
    g2 = grad.reshape(-1, grad.shape[-1])
    gx = gw = gb = None
    if need_w and rebuilt is not None:  # first: the rebuilt input goes before gx is made
        x_hat = rebuilt.whole()
        gw = g2.t() @ x_hat.reshape(-1, x_hat.shape[-1])
        del x_hat
    if need_x:
        gx = (g2 @ weight).view(x_shape)
    if need_b:
        gb = g2.sum(0)
    return gx, gw, gb
