"""The DropIT layers as ``torch.library`` operators: converted layers run them in ``torch.compile``.

Dynamo cannot trace the eager path (the autograd Functions, the hooked conv): its packs are shared
through Python state on tensors and seeded from Python integers up to 2**64, which Inductor cannot
hold as constants. While compiling, a converted layer calls the operators below instead, each
opaque, with a fake (shape-only) implementation and an autograd formula (its Function's backward
body reading the traced ``dropit::unpack``), so that ``torch.compile(model, fullgraph=True)``
traces the whole model into one graph and no seed becomes a graph constant:

- ``dropit::pack`` runs the eager strategy code, drawn with the cache's next key
  (``dropit::draw``): byte-equal to the eager pack of the same step and layer as long as the graph
  packs in program order (tests/core/test_dropit_compile.py); ``dropit::unpack`` rebuilds it.
- ``dropit::conv`` / ``dropit::linear``: the plain op forward; backward reads the pack.
- ``dropit::relu_mask`` / ``dropit::relu_mask_grad``: the ReLU that keeps a 1-bit mask.
- ``dropit::batch_norm`` / ``dropit::group_norm``: in :mod:`dropit_core.layers.norm`.

With ``configure(fuse=True)`` (``DROPIT_FUSE=1``) a quant pack and the ReLU's mask are plain torch
ops instead, which Inductor fuses; only the draw stays opaque. Layers fed one tensor make identical
``dropit::pack`` calls, which the compiler merges: one pack, as eagerly. Only strategies whose pack
sizes follow from the input's shape (``quant``) are traced; the others run their eager Function
behind a graph break (``torch.compiler.disable``). The max-pool's Function traces as it is.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dropit_core import settings
from dropit_core.formats.packed import Packed, QuantMeta
from dropit_core.formats.quant import code_bytes, whole_bytes
from dropit_core.formats.seeds import MASK32, TABLE_BITS, UNIFORM_BITS, mix32
from dropit_core.layers.cache import InputCache, cache_by_number
from dropit_core.layers.functions import ConvArgs, Rebuilt, conv_grads, linear_grads
from dropit_core.layers.relu import relu_and_mask, relu_mask_grad
from dropit_core.strategies.quant import Quant


def traceable(cache: InputCache) -> bool:
    """Whether ``cache``'s packs are traced (sizes from the shape) or made behind a graph break."""
    return _static_fields(cache, (1,), torch.float32) is not None


def _static_fields(
    cache: InputCache, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...] | None:
    """(field, shape, dtype) of each tensor of the pack of a ``shape`` input in ``dtype``, in
    ``Packed`` order, or None where the sizes depend on the data."""
    strategy = cache.strategy
    if type(strategy) is not Quant or strategy.rescale != "none":
        return None
    n = math.prod(shape)
    groups = -(-n // strategy.group)
    return (
        ("values", (code_bytes(n, strategy.bits),), torch.uint8),
        ("scales", (groups,), torch.float32),
        ("mins", (groups,), torch.float32),
    )


@torch.library.custom_op("dropit::pack", mutates_args=())
def pack_op(x: Tensor, keys: Tensor, cache: int, layout: str, dtype: torch.dtype) -> list[Tensor]:
    """The tensors of ``cache``'s eager pack of ``x`` read as ``dtype``, drawn with the hash keys
    ``keys`` (device data, so that a replayed CUDA graph draws each step's)."""
    packed = cache_by_number(cache).strategy.pack_keyed(x, keys, dtype)
    return [t for t in packed[1:] if t is not None]


@pack_op.register_fake
def _(x: Tensor, keys: Tensor, cache: int, layout: str, dtype: torch.dtype) -> list[Tensor]:
    fields = _static_fields(cache_by_number(cache), tuple(x.shape), dtype)
    return [x.new_empty(shape, dtype=kind) for _, shape, kind in fields]


@torch.library.custom_op("dropit::unpack", mutates_args=())
def unpack_op(fields: list[Tensor], cache: int, shape: list[int], dtype: torch.dtype) -> Tensor:
    """The input rebuilt from a traced pack's tensors."""
    owner = cache_by_number(cache)
    names = [name for name, _, _ in _static_fields(owner, tuple(shape), dtype)]
    packed = Packed(QuantMeta(tuple(shape), dtype), **dict(zip(names, fields, strict=True)))
    return owner.unpack(packed)


@unpack_op.register_fake
def _(fields: list[Tensor], cache: int, shape: list[int], dtype: torch.dtype) -> Tensor:
    return fields[0].new_empty(shape, dtype=dtype)


def pack(cache: InputCache, x: Tensor, layout: str, dtype: torch.dtype) -> list[Tensor]:
    """``cache``'s pack of ``x`` read as ``dtype``: in the graph (:func:`_fused_pack`) where it
    can be, else by the opaque ``dropit::pack`` (identical calls merge: one pack, one draw)."""
    fused = _fused_pack(cache, x, dtype)
    if fused is not None:
        return fused
    x = x.detach()
    keys = torch.ops.dropit.draw(x, cache.number)
    return torch.ops.dropit.pack(x, keys, cache.number, layout, dtype)


@torch.library.custom_op("dropit::draw", mutates_args=())
def draw_op(x: Tensor, cache: int) -> Tensor:
    """(k0, k1, 0): the hash keys of ``cache``'s next pack and the index of its first element,
    int64 on ``x``'s device (``InputCache.draw_row``): the eager pack's draw. ``x`` only names
    the pack, so that layers fed one tensor share a draw as they share the pack."""
    return cache_by_number(cache).draw_row(x.device)


@draw_op.register_fake
def _(x: Tensor, cache: int) -> Tensor:
    return x.new_empty((3,), dtype=torch.int64)


def _fused_pack(cache: InputCache, x: Tensor, dtype: torch.dtype) -> list[Tensor] | None:
    """A quant pack as plain torch ops (:func:`quant_fields`, the eager bytes), its own Inductor
    kernel, reading ``x`` once it is made (the opaque draw needs ``x``, which names the shared
    pack). None where it cannot be, e.g. for ``x`` read through an autocast cast (fused into its
    consumer, Inductor would skip the cast's rounding unless ``emulate_precision_casts``)."""
    strategy = cache.strategy
    if (
        not fuse_enabled()
        or not traceable(cache)
        or not whole_bytes(strategy.bits, strategy.group)
        or dtype != x.dtype
        or x.numel() == 0
        or x.numel() % strategy.group  # a guard of the compiled graph under dynamic shapes
    ):
        return None
    x = x.detach()
    keys = torch.ops.dropit.draw(x, cache.number)
    rows = x.reshape(-1, strategy.group)
    codes, mins, scales = quant_fields(rows, keys, strategy.bits, strategy.inv_levels)
    return [codes, scales, mins]  # Packed's order (values, scales, mins)


def quant_fields(
    rows: Tensor, params: Tensor, bits: int, inv_levels: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(codes, minima, steps) of ``rows`` (one group each, whole bytes of codes) in plain torch
    ops that Inductor fuses: ``formats.quant.quantize`` and ``formats.seeds.hash_bits`` op for
    op, the eager bytes. ``params``: the hash keys k0, k1 (int64; a tensor: no recompile)."""
    levels, per_byte = (1 << bits) - 1, 8 // bits
    g = rows.float()
    lo = g.amin(1)
    scale = ((g.amax(1) - lo) * inv_levels).clamp_min(torch.finfo(torch.float32).tiny)
    idx = torch.arange(rows.numel(), device=rows.device).view(rows.shape)
    low = mix32(((idx & ((1 << TABLE_BITS) - 1)) + params[0]) & MASK32)
    high = mix32(((idx >> TABLE_BITS) + params[1]) & MASK32)
    noise = (low >> (32 - UNIFORM_BITS)) ^ (high >> (32 - UNIFORM_BITS))
    y = (g - lo[:, None]) / scale[:, None] + noise.float() * 2.0**-UNIFORM_BITS
    code = y.clamp_max(levels).to(torch.uint8).view(-1, per_byte)
    packed = code[:, 0]
    for j in range(1, per_byte):
        packed = packed | (code[:, j] << (bits * j))
    return packed.view(-1), lo, scale


def fuse_enabled() -> bool:
    """Whether a traced pack or ReLU mask is written as plain torch ops (``settings.fuse``:
    default off, on the CPU a compile several times longer and no faster step; docs/dropit.md)."""
    return settings.current().fuse


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


conv_op = torch.library.custom_op("dropit::conv", _convolution, mutates_args=())
conv_op.register_fake(_convolution)


def _layer_setup(ctx, inputs, output) -> None:
    """Setup of ``dropit::conv`` and ``dropit::linear`` (``args``: the conv's; none)."""
    x, weight, bias, fields, *args, cache = inputs
    ctx.args, ctx.cache, ctx.x_shape, ctx.x_dtype = args, cache, list(x.shape), x.dtype
    ctx.save_for_backward(weight, *fields)


class _TracedRebuilt(Rebuilt):
    """A traced pack's tensors read back through the opaque ``dropit::unpack`` (the backward
    formula is traced too), whole: ``cache`` is the cache's number, ``packed`` the fields."""

    __slots__ = ("dtype",)

    def __init__(self, shape: list[int], cache: int, fields: list[Tensor], dtype) -> None:
        super().__init__(shape, cache, fields)
        self.dtype = dtype

    def read_whole(self) -> Tensor:
        return torch.ops.dropit.unpack(self.packed, self.cache, self.shape, self.dtype)

    def read_part(self, start: int, stop: int) -> None:
        return None


def _rebuilt(ctx, fields: list[Tensor]) -> Rebuilt | None:
    """The backward's reader of the pack ``fields``."""
    return _TracedRebuilt(ctx.x_shape, ctx.cache, fields, ctx.x_dtype) if fields else None


def _conv_backward(ctx, grad):
    weight, *fields = ctx.saved_tensors
    args = ConvArgs(*ctx.args)
    grads = conv_grads(grad, weight, ctx.x_shape, args, ctx.needs_input_grad, _rebuilt(ctx, fields))
    # a gradient per input: the pack's list gets a list of Nones
    return *grads, [None] * len(fields), None, None, None, None, None, None, None


conv_op.register_autograd(_conv_backward, setup_context=_layer_setup)


def conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    args: ConvArgs,
    cache: InputCache,
    dtype: torch.dtype | None,
) -> Tensor:
    """The traced form of ``DropITConvFunction.apply``: the same output, pack and gradients."""
    used = x if dtype is None else x.to(dtype)
    fields = pack(cache, x, "conv", used.dtype) if weight.requires_grad else []
    return torch.ops.dropit.conv(used, weight, bias, fields, *args, cache.number)


def _linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, fields: list[Tensor], cache: int
) -> Tensor:
    """``F.linear`` (its own fake too); the backward's weight gradient reads the pack ``fields``."""
    return torch.nn.functional.linear(x, weight, bias)


linear_op = torch.library.custom_op("dropit::linear", _linear, mutates_args=())
linear_op.register_fake(_linear)


def _linear_backward(ctx, grad):
    weight, *fields = ctx.saved_tensors
    grads = linear_grads(grad, weight, ctx.x_shape, ctx.needs_input_grad, _rebuilt(ctx, fields))
    return *grads, [None] * len(fields), None


linear_op.register_autograd(_linear_backward, setup_context=_layer_setup)


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, cache: InputCache, dtype: torch.dtype | None
) -> Tensor:
    """The traced form of ``DropITLinearFunction.apply``."""
    used = x if dtype is None else x.to(dtype)
    fields = pack(cache, x, "linear", used.dtype) if weight.requires_grad else []
    return torch.ops.dropit.linear(used, weight, bias, fields, cache.number)


@torch.library.custom_op("dropit::relu_mask", mutates_args=())
def relu_mask_op(x: Tensor) -> tuple[Tensor, Tensor]:
    """(relu(x), the packed flags of ``relu(x) <= 0``), as ``MaskedReLUFunction`` keeps them."""
    return relu_and_mask(x, False)


@relu_mask_op.register_fake
def _(x: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty(((x.numel() + 7) // 8,), dtype=torch.uint8)


@torch.library.custom_op("dropit::relu_mask_grad", mutates_args=())
def relu_mask_grad_op(grad: Tensor, bits: Tensor) -> Tensor:
    """The ReLU's input gradient from its output gradient and mask."""
    return relu_mask_grad(grad, bits)


@relu_mask_grad_op.register_fake
def _(grad: Tensor, bits: Tensor) -> Tensor:
    return torch.empty_like(grad)


def _relu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1])


def _relu_backward(ctx, grad, _bits_grad):
    return torch.ops.dropit.relu_mask_grad(grad, *ctx.saved_tensors)  # the mask's bits


relu_mask_op.register_autograd(_relu_backward, setup_context=_relu_setup)


def relu(x: Tensor, inplace: bool) -> Tensor:
    """The traced form of ``MaskedReLUFunction.apply``: :class:`_MaskedReLU`, which Inductor
    fuses, or the opaque ``dropit::relu_mask`` (per ``settings.fuse``). In place: copied into x,
    which the compiler turns back into one buffer."""
    out = _MaskedReLU.apply(x) if fuse_enabled() else torch.ops.dropit.relu_mask(x)[0]
    return x.copy_(out) if inplace else out


class _MaskedReLU(torch.autograd.Function):
    """ReLU keeping the packed flags of ``output <= 0`` (eager's bytes: 8 flags a byte, flag i
    in bit i), in torch ops that Dynamo traces into the graph; backward zeroes the flagged
    gradients (+0.0, as eager's mask does; NaN passes)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        out = torch.relu(x)
        flags = (out <= 0).reshape(-1).to(torch.uint8)
        flags = torch.nn.functional.pad(flags, (0, (-flags.numel()) % 8)).view(-1, 8)
        bits = flags[:, 0]
        for i in range(1, 8):
            bits = bits | (flags[:, i] << i)
        ctx.save_for_backward(bits)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (bits,) = ctx.saved_tensors
        shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
        flags = ((bits[:, None] >> shifts) & 1).reshape(-1)[: grad.numel()]
        return torch.where(flags.view(grad.shape).bool(), 0.0, grad)
