"""The DropIT layers while compiling (docs/dropit.md, "Under torch.compile"): the ``torch.library``
operators they share (``dropit::pack``, ``dropit::draw``, ``dropit::unpack``, :func:`layer_op`) and
a conv or linear layer's call (:func:`run`).

Dynamo cannot trace the Functions (packs shared through Python state on tensors, seeds up to
2**64): each layer calls an opaque operator of its own, with a fake and an autograd formula (its
Function's backward body), so that no seed becomes a graph constant. Only strategies whose pack
sizes follow from the shape (``quant``) are traced; the others run their Function behind a graph
break. Under ``configure(fuse=True)`` a quant pack is plain torch ops that Inductor fuses.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from dropit_core.backends import dispatch
from dropit_core.formats.bits import pack_low_bits
from dropit_core.formats.packed import Packed, QuantMeta
from dropit_core.formats.quant import code_bytes, quantize, whole_bytes
from dropit_core.formats.seeds import keyed_bits
from dropit_core.layers.cache import InputCache, Rebuilt, cache_by_number
from dropit_core.layers.casts import autocast_inputs
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
    """(k0, k1, 0) int64 on ``x``'s device: the hash keys of ``cache``'s next pack (the eager
    draw). ``x`` only names the pack: layers fed one tensor make one call, merged."""
    return cache_by_number(cache).draw_row(x.device)


@draw_op.register_fake
def _(x: Tensor, cache: int) -> Tensor:
    return x.new_empty((3,), dtype=torch.int64)


def _fused_pack(cache: InputCache, x: Tensor, dtype: torch.dtype) -> list[Tensor] | None:
    """A quant pack as plain torch ops (:func:`dropit_core.formats.quant.quantize`, the eager
    bytes) that Inductor fuses; None where it is not (:func:`dispatch.fused`) or cannot be
    (docs/dropit.md, "Fused packs and masks")."""
    strategy, n = cache.strategy, x.numel()
    allowed = (
        traceable(cache)
        and whole_bytes(strategy.bits, strategy.group)
        and dtype == x.dtype
        and n > 0
        and n % strategy.group == 0  # a guard of the compiled graph under dynamic shapes
    )
    if not dispatch.fused(allowed):
        return None
    x = x.detach()
    keys = torch.ops.dropit.draw(x, cache.number)
    noise = keyed_bits((keys[0], keys[1]), 0, n, x.device)
    codes, mins, scales = quantize(x.reshape(-1, strategy.group), noise, strategy.bits)
    return [pack_low_bits(codes, strategy.bits), scales, mins]  # Packed's order


class TracedRebuilt(Rebuilt):
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


def rebuilt(ctx, fields: list[Tensor]) -> TracedRebuilt | None:
    """A traced backward's reader of the pack ``fields`` (None: no pack) of ``ctx``'s input."""
    return TracedRebuilt(ctx.x_shape, ctx.cache, fields, ctx.x_dtype) if fields else None


def layer_op(name: str, forward: Callable[..., Tensor], grads: Callable[..., tuple]) -> None:
    """Define ``dropit::<name>``, a conv or linear layer's operator: ``forward(x, weight, bias,
    fields, *args, cache)`` (its own fake too), whose backward is ``grads(grad, weight, ctx,
    rebuilt)`` on the kept weight and pack ``fields`` (``args``: the conv's; none)."""
    op = torch.library.custom_op(f"dropit::{name}", forward, mutates_args=())
    op.register_fake(forward)

    def setup(ctx, inputs, output) -> None:
        x, weight, bias, fields, *args, cache = inputs
        ctx.args, ctx.cache, ctx.x_shape, ctx.x_dtype = args, cache, list(x.shape), x.dtype
        ctx.save_for_backward(weight, *fields)

    def backward(ctx, grad):
        weight, *fields = ctx.saved_tensors
        out = grads(grad, weight, ctx, rebuilt(ctx, fields))
        # a gradient per input: the pack's list gets a list of Nones, the args and cache None
        return *out, [None] * len(fields), *[None] * (len(ctx.args) + 1)

    op.register_autograd(backward, setup_context=setup)


def eager(function, x: Tensor, weight: Tensor, bias: Tensor | None, cache, *args) -> Tensor:
    """A conv or linear layer's eager call: its autograd ``function`` of autocast's casts."""
    w, b, dtype = autocast_inputs(x, weight, bias, cache)
    return function.apply(x, w, b, cache, dtype, *args)


# A graph break (a decorated copy: the eager path pays no wrapper).
_behind_break = torch.compiler.disable(eager)


def run(function, traced, layout: str, x: Tensor, weight, bias, cache: InputCache, *args) -> Tensor:
    """A conv or linear layer's DropIT call: :func:`eager`, or :func:`compiled` while compiling."""
    if torch.compiler.is_compiling():
        return compiled(function, traced, layout, x, weight, bias, cache, *args)
    return eager(function, x, weight, bias, cache, *args)


def compiled(
    function,
    traced: Callable[..., Tensor],
    layout: str,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    cache: InputCache,
    *args,
) -> Tensor:
    """A conv or linear layer's call while compiling: ``traced(x, weight, bias, fields, cache
    number, *args)`` on the layer's pack ``fields`` (none for a frozen weight) where ``cache``'s
    packs trace, else its autograd ``function`` behind a graph break."""
    if not traceable(cache):
        return _behind_break(function, x, weight, bias, cache, *args)
    w, b, dtype = autocast_inputs(x, weight, bias, None)
    used = x if dtype is None else x.to(dtype)
    fields = pack(cache, x, layout, used.dtype) if w.requires_grad else []
    return traced(used, w, b, fields, cache.number, *args)
