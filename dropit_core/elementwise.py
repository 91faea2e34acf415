"""The slice-by-slice pack and rebuild shared by the strategies that keep single elements.

An element-wise pack keeps a 1-bit position mask (or, for a mask drawn from a seed, nothing) plus
the kept values; a subclass says which elements a slice keeps (:meth:`Elementwise._slice_mask`)
and, optionally, a per-tensor state computed first (:meth:`Elementwise._begin`: a threshold, a
seed). On the CPU the pack is one pass; on an accelerator it avoids data-dependent shapes
(:func:`counts_first`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import base
from .base import ElementsMeta, Packed, Strategy, decoded, encoded
from .packing import ValueCodec, compact, compact_bits, pack_bits, scatter_kept, unpack_bits
from .registry import Option

POSITIONS = ("bits", "sparse_bits")
POSITIONS_OPTION = Option(
    "positions",
    str,
    POSITIONS[0],
    "the kept positions: a 1-bit mask, or only its non-zero bytes plus 1 bit per mask byte",
    choices=POSITIONS,
)
SAMPLE_OPTION = Option(
    "sample",
    int,
    1 << 16,
    "elements read at a prime stride to estimate the threshold (quantile or tau)",
    minimum=1,
)


def counts_first(device: torch.device) -> bool:
    """Whether packing must avoid data-dependent shapes: on an accelerator each would be a sync.

    There, element-wise packs count the kept elements of every slice first, read all counts in
    one host sync per layer, then gather with ``nonzero_static``. On the CPU a boolean index is
    as cheap as counting, so the pack is one pass.
    """
    return device.type != "cpu"


def host_ints(values: list[torch.Tensor]) -> list[int]:
    """The one device-to-host read of an element-wise pack."""
    return torch.stack(values).tolist() if values else []


def _sparse_bits(bits: torch.Tensor, nonzero: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(which bytes of the mask are non-zero, 1 bit each; those bytes): at gamma 0.9 a fifth to
    half of the mask bytes are zero, and storing a zero byte as one bit saves 7/8 of it."""
    flags = bits != 0
    return pack_bits(flags), compact(bits, flags, nonzero)


def _dense_bits(flags: torch.Tensor, nonzero: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`_sparse_bits` for a mask of n elements."""
    n_bytes = (n + 7) // 8
    # one slice of whole mask bytes: the same rebuild as the values' (scatter_kept)
    return scatter_kept(flags, nonzero, n_bytes, max(8, 8 * len(flags)))


class Elementwise(Strategy):
    """Keep single elements: a packed 1-bit position mask plus the kept values.

    ``positions="sparse_bits"`` stores the mask's non-zero bytes plus one bit per mask byte. A
    subclass with ``stores_mask = False`` rebuilds its mask from the pack's state instead
    (:meth:`_rebuild_mask`).
    """

    stores_mask = True

    def __init__(
        self, gamma: float, codec: ValueCodec, rescale: str, *, positions: str = POSITIONS[0]
    ) -> None:
        super().__init__(gamma, codec, rescale)
        self.positions = positions

    def _begin(self, flat: torch.Tensor, static: bool, key: int) -> tuple[Any, torch.Tensor | None]:
        """Per-tensor state computed once before the slices (e.g. a global threshold, a seed).

        Returns (state, ok): ``ok`` is None or a 0-dim bool tensor that the pack reads with its
        counts; False means the state is unusable and :meth:`_exact` must redo it. ``static``:
        no host syncs allowed here (see :func:`counts_first`).
        """
        return None, None

    def _exact(self, flat: torch.Tensor) -> Any:
        """A state that is always right, for when :meth:`_begin` reported a miss."""
        raise NotImplementedError

    def _slice_mask(self, piece: torch.Tensor, start: int, state: Any) -> torch.Tensor:
        """Which elements of ``piece`` (starting at flat index ``start``) to keep; by default
        the magnitudes at or above the threshold ``state`` (mink, threshold)."""
        return piece.abs() >= state

    def _rebuild_mask(
        self, start: int, length: int, state: Any, device: torch.device
    ) -> torch.Tensor:
        """The mask of a slice rebuilt from the state alone (``stores_mask = False`` only)."""
        raise NotImplementedError

    def _rebuilt_values(self, values: torch.Tensor, packed: Packed) -> torch.Tensor:
        """What the kept values rebuild as (by default themselves)."""
        return values

    def slice_len(self) -> int:
        """Elements per slice of the pack and the rebuild."""
        return base.SLICE

    def _pack(self, x: torch.Tensor, layout: str, key: int) -> Packed:
        flat = x.reshape(-1)
        nonzero_bytes = None
        if counts_first(flat.device):
            bits, values, counts, state, nonzero_bytes = self._pack_counts_first(flat, key)
        else:
            bits, values, counts, state = self._pack_one_pass(flat, key)
        if not values:  # an empty input
            values, bits = [flat], [pack_bits(flat.new_zeros(0, dtype=torch.bool))]
        vals = values[0] if len(values) == 1 else torch.cat(values)
        fields = encoded(self.codec, vals)
        if self.stores_mask:
            packed_bits = bits[0] if len(bits) == 1 else torch.cat(bits)
            if self.positions == "sparse_bits":
                fields["bits"], fields["mask_bytes"] = _sparse_bits(packed_bits, nonzero_bytes)
            else:
                fields["bits"] = packed_bits
        return Packed(ElementsMeta(tuple(x.shape), x.dtype, tuple(counts), state), **fields)

    def _pack_one_pass(self, flat: torch.Tensor, key: int):
        state, ok = self._begin(flat, False, key)
        if ok is not None and not bool(ok):
            state = self._exact(flat)
        return self._pack_with_state(flat, state)

    def _pack_with_state(self, flat: torch.Tensor, state: Any):
        step = self.slice_len()
        bits, values, counts = [], [], []
        for start in range(0, flat.numel(), step):
            piece = flat[start : start + step]
            mask = self._slice_mask(piece, start, state)
            if self.stores_mask:  # compacting from the packed bits beats a boolean index
                bits.append(pack_bits(mask))
                kept = compact_bits(piece, bits[-1])
            else:
                kept = compact(piece, mask)
            values.append(kept)
            counts.append(kept.numel())
        return bits, values, counts, state

    def _masks_and_counts(self, flat: torch.Tensor, state: Any):
        """Per slice: the mask bits, the kept count and, for sparse bits, the non-zero bytes."""
        step = self.slice_len()
        bits, counts, nonzero = [], [], []
        for start in range(0, flat.numel(), step):
            mask = self._slice_mask(flat[start : start + step], start, state)
            counts.append(torch.count_nonzero(mask))
            if self.stores_mask:
                bits.append(pack_bits(mask))
                if self.positions == "sparse_bits":
                    nonzero.append(torch.count_nonzero(bits[-1]))
        return bits, counts, nonzero

    def _pack_counts_first(self, flat: torch.Tensor, key: int):
        state, ok = self._begin(flat, True, key)
        bits, counts, nonzero = self._masks_and_counts(flat, state)
        flags = [] if ok is None else [ok.to(torch.int64)]
        host = host_ints(counts + nonzero + flags)
        if flags and not host[-1]:  # rare: the state was a miss; redo it exactly (more syncs)
            state = self._exact(flat)
            bits, counts, nonzero = self._masks_and_counts(flat, state)
            host = host_ints(counts + nonzero)
        nonzero_bytes = sum(host[len(counts) : len(counts) + len(nonzero)])
        counts = host[: len(counts)]
        step = self.slice_len()
        values = []
        for i, start in enumerate(range(0, flat.numel(), step)):
            piece = flat[start : start + step]
            if self.stores_mask:  # unpacking the bits reads n/8 bytes, not the input again
                mask = unpack_bits(bits[i], piece.numel())
            else:
                mask = self._slice_mask(piece, start, state)
            values.append(compact(piece, mask, counts[i]))
        return bits, values, counts, state, nonzero_bytes

    def _unpack(self, packed: Packed) -> torch.Tensor:
        shape, dtype, counts, state = packed.meta
        n = math.prod(shape)
        values = self._rebuilt_values(decoded(self.codec, packed, dtype, sum(counts)), packed)
        step = self.slice_len()
        if self.stores_mask:
            bits = packed.bits
            if self.positions == "sparse_bits":
                bits = _dense_bits(bits, packed.mask_bytes, n)
            return scatter_kept(bits, values, n, step).view(shape)
        dense = torch.zeros(n, dtype=dtype, device=values.device)
        offset = 0
        # One slice's mask at a time: the only full-size tensor alive here is `dense` itself.
        for i, start in enumerate(range(0, n, step)):
            length = min(step, n - start)
            mask = self._rebuild_mask(start, length, state, values.device)
            dense[start : start + length].masked_scatter_(mask, values[offset : offset + counts[i]])
            offset += counts[i]
        return dense.view(shape)
