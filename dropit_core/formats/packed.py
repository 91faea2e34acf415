"""The packed cache every strategy returns: :class:`Packed`, its metadata types, and the rules
every pack follows (read by one backward; tagged so that ``compress_saved`` leaves it alone).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


def tiny(dtype: torch.dtype) -> float:
    """The smallest normal number of ``dtype``: the floor of every magnitude threshold."""
    return torch.finfo(dtype).tiny


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
    """A packed layer input: its metadata, then its tensors by role (None where not kept), saved
    for backward in field order (``packed[1:]``) and read back as ``Packed(meta, *saved)``."""

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
        return tuple(t for t in self[1:] if t is not None)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.stored())


def quant_packed(shape: tuple, dtype: torch.dtype, codes, scales, mins) -> Packed:
    """``Packed(QuantMeta(shape, dtype), values=codes, scales=scales, mins=mins)``, made as plain
    tuples (a NamedTuple's constructor is Python, and every layer makes one: host time)."""
    meta = tuple.__new__(QuantMeta, (shape, dtype))
    return tuple.__new__(Packed, (meta, None, None, None, codes, scales, mins, None, None, None))


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
    """Mark the pack's float tensors, so that ``compress_saved`` does not compress them again."""
    for t in packed[4:]:  # bits, mask_bytes and index are integers
        if t is not None and t.is_floating_point():
            setattr(t, PACK_TAG, True)


def pack_made(t: torch.Tensor, attr: str, key: tuple) -> Any:
    """The pack made earlier of ``t`` under ``key`` (its forward and ``t._version``), or None: a
    tensor read by several layers is packed once (kept on the tensor, dying with it)."""
    hit = getattr(t, attr, None)
    return hit[1] if hit is not None and hit[0] == key else None


def keep_pack(t: torch.Tensor, attr: str, key: tuple, packed: Any) -> None:
    """Remember ``packed`` as ``t``'s pack under ``key`` (:func:`pack_made` reads it)."""
    setattr(t, attr, (key, packed))
