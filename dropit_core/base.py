"""What every strategy shares: the packed cache, the metadata types, and the Strategy base class.

A pack is a :class:`Packed`: the tensors a strategy keeps, each in a named field (``None`` where a
strategy keeps no such part), plus a named tuple of plain-Python metadata. The base class owns
the options every strategy takes: how kept values are stored (a :class:`ValueCodec`) and the
``rescale`` of the rebuilt input (declared, applied in :meth:`Strategy.pack` /
:meth:`Strategy.unpack`, and described here, nowhere else).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .packing import VALUE_FORMATS, ValueCodec
from .registry import Option
from .select import tiny

# Element-wise strategies, norms and quantisation work through a tensor in slices of this many
# elements, so that their temporaries stay a few MB however large the layer input is.
SLICE = 1 << 22


class ElementsMeta(NamedTuple):
    """What an element-wise pack passes to its unpack besides the tensors."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    kept: int  # value slots: the kept count (CPU), or a capacity from the shape (accelerators)
    state: Any  # the |x| threshold (mink, threshold), the mask seed (random) or None


class UnitsMeta(NamedTuple):
    """What a plane/feature-column pack (channel_*) passes to its unpack."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str
    width: int  # elements per plane or feature column


class BlocksMeta(NamedTuple):
    """What a block_mink pack passes to its unpack: the plane grid before and after padding."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    planes: int
    height: int
    width: int
    block_rows: int
    block_cols: int


class PoolMeta(NamedTuple):
    """What a pool pack passes to its unpack."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str
    pooled_shape: tuple[int, ...]


class QuantMeta(NamedTuple):
    """What a quant pack passes to its unpack."""

    shape: tuple[int, ...]
    dtype: torch.dtype


PackMeta = ElementsMeta | UnitsMeta | BlocksMeta | PoolMeta | QuantMeta


class Packed(NamedTuple):
    """A packed layer input: its metadata, then its tensors by role (None where not kept).

    The tensor fields travel through ``ctx.save_for_backward`` in field order (``packed[1:]``,
    ``None`` included) and come back as ``Packed(meta, *saved)``: autograd owns them, and
    saved-tensor hooks see every byte.
    """

    meta: PackMeta
    bits: torch.Tensor | None = None  # kept positions, 1 bit each (sparse_bits: 1 per mask byte)
    mask_bytes: torch.Tensor | None = None  # sparse_bits: the non-zero bytes of the position mask
    index: torch.Tensor | None = None  # kept planes, feature columns or blocks (int32)
    values: torch.Tensor | None = None  # kept values, or their codes (int8, int4, quant)
    scales: torch.Tensor | None = None  # one fp32 scale per chunk (int8, int4) or group (quant)
    mins: torch.Tensor | None = None  # quant: the fp32 minimum of each group
    threshold: torch.Tensor | None = None  # importance: tau, fp32
    norm: torch.Tensor | None = None  # rescale="norm": the input's L2 norm, fp32
    dropped: torch.Tensor | None = None  # chosen values a fixed capacity could not hold (int64)

    def stored(self) -> tuple[torch.Tensor, ...]:
        """The tensors this pack keeps."""
        return tuple(t for t in self[1:] if t is not None)

    def nbytes(self) -> int:
        """Bytes of the tensors this pack keeps."""
        return sum(t.nbytes for t in self.stored())


def encoded(
    codec: ValueCodec, values: torch.Tensor, keep_sign: bool = False
) -> dict[str, torch.Tensor | None]:
    """The ``values``/``scales`` fields of a pack whose kept values ``codec`` stores
    (``keep_sign``: see :meth:`ValueCodec.encode`)."""
    parts = codec.encode(values, keep_sign)
    return {"values": parts[0], "scales": parts[1] if len(parts) > 1 else None}


def decoded(codec: ValueCodec, packed: Packed, dtype: torch.dtype, count: int) -> torch.Tensor:
    """The kept values of ``packed`` (``count`` of them) decoded to ``dtype``."""
    parts = (packed.values,) if packed.scales is None else (packed.values, packed.scales)
    return codec.decode(parts, dtype, count)


# How a rebuilt input is scaled before the weight gradient: as it is, or to the input's L2 norm.
RESCALES = ("none", "norm")
# Options every strategy takes (unless it names them in ``skips_common``): how the kept values
# are stored (see ValueCodec), and the rescale.
COMMON_OPTIONS = (
    Option("values", str, "same", "how kept values are stored", choices=VALUE_FORMATS),
    Option("int8_chunk", int, ValueCodec.int8_chunk, "values per fp32 scale of `int8`", minimum=1),
    Option("int4_chunk", int, ValueCodec.int4_chunk, "values per fp32 scale of `int4`", minimum=1),
    Option(
        "rescale",
        str,
        "none",
        "`norm`: scale each rebuilt input by the L2 norm ratio of the input to the rebuilt one, "
        "so the weight gradient keeps the exact gradient's scale",
        choices=RESCALES,
    ),
)
# The common options that build the codec, and the ValueCodec field each sets.
CODEC_OPTIONS = {"values": "fmt", "int8_chunk": "int8_chunk", "int4_chunk": "int4_chunk"}
SEED = Option(
    "seed", int, 0, "seed of the random draws, mixed with the step and the layer (`set_step`)"
)


def keep_count(gamma: float, n: int) -> int:
    """How many of n elements (or units) a drop of ``gamma`` keeps."""
    return int((1.0 - gamma) * n)


class Strategy:
    """Base class: pick what to keep of a layer input and rebuild a dense tensor from it.

    A subclass declares its ``name``, its ``options`` (passed to ``__init__`` as keywords, with
    the registry's defaults filled in) and, for the docs, what it ``keeps`` and its
    ``cache_bytes``; it implements :meth:`_pack` and :meth:`_unpack`. ``draws``: whether a pack
    draws random numbers (from its ``key``); ``uses_gamma``: whether gamma means anything to it;
    ``skips_common``: common options that do not apply to it; ``reads_through_cast``: whether
    it implements :meth:`_pack_cast` (packs an autocast input from the tensor it was cast from).
    """

    name = ""
    options: tuple[Option, ...] = ()
    keeps = ""
    cache_bytes = ""
    draws = False
    uses_gamma = True
    # Whether the rebuilt tensor estimates every element (nothing dropped): only such a strategy
    # may pack a normalisation layer's input, whose backward reads all of it.
    every_element = False
    skips_common: tuple[str, ...] = ()
    reads_through_cast = False

    def __init__(self, gamma: float, codec: ValueCodec, rescale: str = RESCALES[0]) -> None:
        self.gamma = gamma
        self.codec = codec
        self.rescale = rescale

    def pack(
        self, x: torch.Tensor, layout: str, key: int = 0, dtype: torch.dtype | None = None
    ) -> Packed:
        """Compress ``x`` (a ``"conv"`` or ``"linear"`` input). Random draws are seeded from
        ``key`` (and the strategy's ``seed``): the same key gives the same pack. ``dtype``: the
        dtype the layer computed in (autocast's): the pack is that of ``x.to(dtype)``, made
        without the copy by a strategy that reads through the cast (quant)."""
        if dtype is None or dtype == x.dtype:
            packed = self._pack(x, layout, key)
        elif self.reads_through_cast and self.rescale == RESCALES[0]:
            packed = self._pack_cast(x, layout, key, dtype)
        else:  # the norm below is the cast's
            x = x.to(dtype)
            packed = self._pack(x, layout, key)
        if self.rescale == "norm":  # one more pass over x; the norm rides with the pack
            packed = packed._replace(norm=torch.linalg.vector_norm(x, dtype=torch.float32))
        return packed

    def unpack(self, packed: Packed) -> torch.Tensor:
        """Rebuild a dense tensor of the packed input's shape and dtype; with ``rescale="norm"``
        scaled to the input's L2 norm (dropping small elements shrinks the weight gradient by the
        same factor)."""
        x_hat = self._unpack(packed)
        if packed.norm is None:
            return x_hat
        rebuilt = torch.linalg.vector_norm(x_hat, dtype=torch.float32)
        # An all-zero rebuild stays zero (no division by zero); no host sync either way.
        scale = torch.where(rebuilt > 0, packed.norm / rebuilt.clamp_min(tiny(torch.float32)), 1.0)
        # Out of place: some strategies rebuild as a view of a cached tensor, which layers share.
        return x_hat * scale.to(x_hat.dtype)

    def unpack_part(self, packed: Packed, start: int, stop: int) -> torch.Tensor | None:
        """Elements ``[start, stop)`` of the flat rebuilt input, the same values as
        ``unpack(packed).reshape(-1)[start:stop]`` without rebuilding the rest; None where
        this strategy's pack cannot be read in parts there (the default: nowhere)."""
        return None

    def _pack(self, x: torch.Tensor, layout: str, key: int) -> Packed:
        raise NotImplementedError

    def _pack_cast(self, x: torch.Tensor, layout: str, key: int, dtype: torch.dtype) -> Packed:
        """The pack of ``x.to(dtype)``, bit for bit, read from ``x`` (``reads_through_cast``)."""
        raise NotImplementedError

    def _unpack(self, packed: Packed) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> str:
        """Short human-readable form, e.g. ``mink(gamma=0.8)``."""
        params = [f"gamma={self.gamma}"] if self.uses_gamma else []
        params += self._describe_params()
        if self.rescale != RESCALES[0]:
            params.append(f"rescale={self.rescale}")
        return f"{self.name}({', '.join(params)})"

    def _describe_params(self) -> tuple[str, ...]:
        """The strategy's own settings worth showing in :meth:`describe`."""
        return ()


DOUBLE_BACKWARD = (
    "DropIT does not support double backward (create_graph=True, e.g. a gradient penalty): the "
    "backward reads a compressed copy of the input, which has no graph to differentiate; use "
    "the plain model (from_dropit) for such a loss"
)


def refuse_double_backward() -> None:
    """Raise in a backward run with ``create_graph=True`` (grad mode on): its second-order
    gradients would be silently wrong, not merely approximate."""
    if torch.is_grad_enabled():
        raise RuntimeError(DOUBLE_BACKWARD)


PACK_TAG = "_dropit_pack"  # on a DropIT pack's float tensors: compress_saved leaves them alone


def tag_pack(packed: Packed) -> None:
    """Mark the pack's float tensors, so that ``compress_saved`` does not compress them a second
    time (values, minima and steps compressed already). Only a pack an autograd Function saves
    needs it: ``compress_saved``'s hooks see what ``save_for_backward`` keeps, never what a
    saved-tensor hook of ours returned (dropit_core.hooked), so the hooked conv skips it."""
    for t in packed[4:]:  # bits, mask_bytes and index are integers
        if t is not None and t.is_floating_point():
            setattr(t, PACK_TAG, True)
