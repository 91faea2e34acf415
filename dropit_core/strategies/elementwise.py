"""The slice-by-slice pack and rebuild shared by the strategies that keep single elements: a
1-bit position mask (or a mask drawn again from a seed) plus the kept values, in flat order.

The values' buffer is sized to the kept count on the CPU, and from the shape on an accelerator
(:func:`fixed_capacity`): a pack that chooses more than its capacity stores the first ones, masks
exactly those and counts the rest in ``Packed.dropped`` (docs/dropit.md, "What a layer stores").
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dropit_core.backends import dispatch
from dropit_core.formats import packed as base
from dropit_core.formats.bits import compact_bits, compact_into, pack_bits, scatter_kept
from dropit_core.formats.keep_rule import KeepRule
from dropit_core.formats.packed import ElementsMeta, Packed
from dropit_core.registry import Option
from dropit_core.strategies.base import Strategy, decoded, encoded

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

# A capacity sized from the shape holds the expected kept count plus this many standard
# deviations of it, plus a few slots: at 8 deviations a normal count overflows about once in
# 1e15 packs, so an overflow means the estimate itself was off, not bad luck.
CAPACITY_SPREAD = 8.0
CAPACITY_SLACK = 64


def fixed_capacity(device: torch.device) -> bool:
    """Whether packs on ``device`` are sized from the shape: on an accelerator (no host wait)."""
    return device.type != "cpu"


def expected_capacity(n: int, p: float, sample: int | None = None, draws: bool = False) -> int:
    """Slots for a count that keeps p of n elements on average, at most n: ``p n`` plus
    :data:`CAPACITY_SPREAD` standard deviations of the count (a threshold estimated from
    ``sample`` values; n independent ``draws``), plus :data:`CAPACITY_SLACK`."""
    variance = 0.0
    if sample:
        variance += n * n * p * (1.0 - p) / sample
    if draws:
        variance += n * p * (1.0 - p)
    return min(n, math.ceil(p * n + CAPACITY_SPREAD * math.sqrt(variance)) + CAPACITY_SLACK)


def _sparse_bits(bits: torch.Tensor, slots: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(which bytes of the mask are non-zero, 1 bit each; those bytes): a zero byte as one bit.
    ``slots``: the pack's value capacity (None: sized to the count), which bounds the non-zero
    bytes (each flags a stored value)."""
    flags = bits != 0
    if slots is None:
        return pack_bits(flags), bits[flags]
    nonzero = bits.new_zeros(min(bits.numel(), slots) + 1)  # + compact_into's spare slot
    compact_into(bits, flags, nonzero, torch.zeros((), dtype=torch.int64, device=bits.device))
    return pack_bits(flags), nonzero[:-1]


def _dense_bits(flags: torch.Tensor, nonzero: torch.Tensor, n: int, kernels: bool) -> torch.Tensor:
    """Inverse of :func:`_sparse_bits` for a mask of n elements (``kernels``: by the Triton
    scatter, which rebuilds bytes as it rebuilds values)."""
    n_bytes = (n + 7) // 8
    if kernels:
        return dispatch.kernels("compact").scatter_pack(flags, nonzero, n_bytes)
    # one slice of whole mask bytes: the same rebuild as the values' (scatter_kept)
    return scatter_kept(flags, nonzero, n_bytes, max(8, 8 * len(flags)))


class Elementwise(Strategy):
    """Keep single elements: a packed 1-bit position mask plus the kept values. A subclass with
    ``stores_mask = False`` rebuilds its mask from the pack's state (:meth:`_rebuild_mask`); one
    with ``exact_capacity = True`` keeps at most its :meth:`capacity` by design (mink: k), so
    nothing past it counts as dropped."""

    stores_mask = True
    exact_capacity = False
    # True: integer value codes never code a non-zero kept value as 0 (its sign is kept)
    signed_values = False
    # Besides eager torch (dispatch.choose's ``allowed``): the kernels where _kernel_rule is stated
    pack_backends: tuple[str, ...] = ()
    positions = POSITIONS[0]  # the option, where the class takes it

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.pack_backends = ("triton",) if cls._kernel_rule is not Elementwise._kernel_rule else ()

    def capacity(self, n: int) -> int:
        """Value slots of a pack of n elements sized from the shape; by default n (all of them)."""
        return n

    def _begin(self, flat: torch.Tensor, static: bool, key: int) -> Any:
        """Per-tensor state computed once before the slices (e.g. a global threshold, a seed).
        ``static``: the pack is sized from the shape, and nothing here may wait for the device."""
        return None

    def _slice_mask(self, piece: torch.Tensor, start: int, state: Any) -> torch.Tensor:
        """Which elements of ``piece`` (starting at flat index ``start``) to keep; by default
        the magnitudes at or above the threshold ``state`` (mink, threshold)."""
        return piece.abs() >= state

    def _rebuild_mask(
        self, start: int, length: int, state: Any, device: torch.device
    ) -> torch.Tensor:
        """The mask of a slice rebuilt from the state alone (``stores_mask = False`` only)."""
        raise NotImplementedError

    def _kernel_rule(self, state: Any) -> KeepRule:
        """The rule of :meth:`_slice_mask` for the Triton kernels; a class that does not state
        it packs with eager torch only. A strategy that stores no mask draws its flags again
        from this rule in the rebuild."""
        raise NotImplementedError

    def _kept_state(self, state: Any) -> Any:
        """What of the state the pack's metadata keeps (by default all of it)."""
        return state

    def _rebuilt_values(self, values: torch.Tensor, packed: Packed) -> torch.Tensor:
        """What the kept values rebuild as (by default themselves)."""
        return values

    def slice_len(self) -> int:
        """Elements per slice of the pack and the rebuild (a multiple of 8: whole mask bytes)."""
        return base.SLICE

    def _pack(self, x: torch.Tensor, layout: str, key: int) -> Packed:
        flat = x.reshape(-1)
        kernels = dispatch.choose("compact", flat, self.pack_backends) == "triton"
        if kernels or fixed_capacity(flat.device):
            bits, values, state, dropped = self._pack_fixed(flat, key, kernels)
            slots = values.numel()
        else:
            bits, values, state = self._pack_tight(flat, key)
            dropped, slots = None, None
        fields = encoded(self.codec, values, self.signed_values)
        fields["bits"] = bits  # None where the mask is drawn again (stores_mask False)
        if self.stores_mask and self.positions == "sparse_bits":
            fields["bits"], fields["mask_bytes"] = _sparse_bits(bits, slots)
        meta = ElementsMeta(tuple(x.shape), x.dtype, values.numel(), self._kept_state(state))
        return Packed(meta, dropped=dropped, **fields)

    def _pack_tight(self, flat: torch.Tensor, key: int):
        """(position bits, kept values, state), the values' buffer sized to their count."""
        bits, values, state = self._pack_one_pass(flat, key)
        if not values:  # an empty input
            values, bits = [flat], [pack_bits(flat.new_zeros(0, dtype=torch.bool))]
        vals = values[0] if len(values) == 1 else torch.cat(values)
        if not self.stores_mask:
            return None, vals, state
        return (bits[0] if len(bits) == 1 else torch.cat(bits)), vals, state

    def _pack_one_pass(self, flat: torch.Tensor, key: int):
        """Per slice: (position bits, kept values), and the state (CPU: host reads are free)."""
        return self._pack_with_state(flat, self._begin(flat, False, key))

    def _pack_with_state(self, flat: torch.Tensor, state: Any):
        step = self.slice_len()
        bits, values = [], []
        for start in range(0, flat.numel(), step):
            piece = flat[start : start + step]
            mask = self._slice_mask(piece, start, state)
            if self.stores_mask:  # compacting from the packed bits beats a boolean index
                bits.append(pack_bits(mask))
                values.append(compact_bits(piece, bits[-1]))
            else:
                values.append(piece[mask])  # the CPU's compaction: its size read on the host
        return bits, values, state

    def _pack_fixed(self, flat: torch.Tensor, key: int, kernels: bool):
        """(position bits, kept values, state, values chosen but not stored) with every size
        from the shape: each slice's values go after the device-side count of those before it,
        so that the host never waits for the device."""
        n, dev = flat.numel(), flat.device
        state = self._begin(flat, True, key)
        slots = self.capacity(n)
        if kernels:  # the Triton kernels: what dispatch chose for flat
            compact_pack = dispatch.kernels("compact").compact_pack
            rule = self._kernel_rule(state)
            bits, values, chosen = compact_pack(flat, rule, slots, self.stores_mask)
            dropped = None if self.exact_capacity else (chosen - slots).clamp_min(0)
            return bits, values, state, dropped
        values = torch.zeros(slots + 1, dtype=flat.dtype, device=dev)  # + compact_into's spare
        bits = None
        if self.stores_mask:
            bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=dev)
        stored = torch.zeros((), dtype=torch.int64, device=dev)
        chosen = torch.zeros((), dtype=torch.int64, device=dev)
        step = self.slice_len()
        for start in range(0, n, step):
            piece = flat[start : start + step]
            mask = self._slice_mask(piece, start, state)
            flags, stored, count = compact_into(piece, mask, values, stored, self.stores_mask)
            chosen += count
            if bits is not None:  # the flags of what was stored: an overflow never misleads
                pack_bits(flags, out=bits[start // 8 : (start + piece.numel() + 7) // 8])
        dropped = None if self.exact_capacity else chosen - stored
        return bits, values[:slots], state, dropped

    def _unpack(self, packed: Packed) -> torch.Tensor:
        shape, dtype, kept, state = packed.meta
        n = math.prod(shape)
        values = self._rebuilt_values(decoded(self.codec, packed, dtype, kept), packed)
        step = self.slice_len()
        allowed = dispatch.FAST if self.stores_mask else self.pack_backends
        kernels = dispatch.choose("compact", values, allowed) == "triton"
        bits = packed.bits  # None where the mask is drawn again (stores_mask False)
        if self.stores_mask and self.positions == "sparse_bits":
            bits = _dense_bits(bits, packed.mask_bytes, n, kernels)
        if kernels:
            rule = None if self.stores_mask else self._kernel_rule(state)
            scatter_pack = dispatch.kernels("compact").scatter_pack
            return scatter_pack(bits, values, n, draw=rule).view(shape)
        if self.stores_mask:
            return scatter_kept(bits, values, n, step).view(shape)

        def slice_bits(start: int, length: int) -> torch.Tensor:
            # One slice's mask at a time: the only full-size tensor alive here is the output.
            return pack_bits(self._rebuild_mask(start, length, state, values.device))

        return scatter_kept(None, values, n, step, slice_bits).view(shape)
