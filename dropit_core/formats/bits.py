"""The torch byte packer, 1-bit position and ReLU masks, the compaction of kept values, and their
rebuild. A kept element costs its value and the position mask 1 bit per element of the tensor:
at gamma=0.8 an fp32 cache costs 0.925 bytes per element, the paper's value + int32 index 1.6.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def pack_low_bits(values: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack a flat uint8 tensor of ``bits``-bit values (1, 2, 4 or 8) into bytes, the first in the
    low bits, a last partial byte padded with zeros (``out``: the buffer): shifts and ORs, which
    Inductor fuses into the kernel that makes the values."""
    per_byte = 8 // bits
    if per_byte == 1:
        return values if out is None else out.copy_(values)
    pad = (-values.numel()) % per_byte
    if pad:
        values = torch.nn.functional.pad(values, (0, pad))
    slots = values.reshape(-1, per_byte)
    packed = slots[:, 0].clone() if out is None else out.copy_(slots[:, 0])
    for j in range(1, per_byte):
        packed |= slots[:, j] << (bits * j)
    return packed


def pack_bits(mask: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack a flat bool tensor into uint8, 8 flags per byte, little-endian (``out``: the buffer)."""
    return pack_low_bits(mask.view(torch.uint8), 1, out)


# Each byte's flags as eight bytes: the byte copied into all eight (a multiply, no carries), bit i
# kept in byte i, then each byte's high bit set where it is not zero (+0x7F: no byte carries).
_SPREAD = 0x0101010101010101
_PICK = 0x8040201008040201 - (1 << 64)  # the 64-bit pattern as the int64 torch takes
_LOW7 = 0x7F7F7F7F7F7F7F7F


def _flag_words(bits: torch.Tensor) -> torch.Tensor:
    """Each byte of ``bits`` as an int64 word whose byte i has its high bit set where flag i is:
    six passes over words, an eighth of the flags' count each."""
    words = bits.to(torch.int64) * _SPREAD  # int64 multiply wraps: bytes of 255 stay bytes
    words &= _PICK
    words += _LOW7
    return words


def unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` flags as a flat bool tensor."""
    words = _flag_words(bits)
    words >>= 7  # the sign's copies land above bit 56, which the mask drops
    words &= _SPREAD
    return words.view(torch.bool).reshape(-1)[:n]


# The integer dtype of each width: masks applied to a float's bit patterns, bits viewed as ints.
SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Elements per slice of the ReLU mask's pack and apply: a multiple of 8 (whole bytes of flags);
# the temporaries of a slice (a byte and a few int64 words per element) stay a few MB.
MASK_SLICE = 1 << 20


def pack_blocked(out: torch.Tensor) -> torch.Tensor:
    """``pack_bits((out <= 0).reshape(-1))``, a slice at a time: the same bytes, with the
    comparison's and the packing's temporaries a slice's, not a whole map's."""
    flat = out.reshape(-1)
    n = flat.numel()
    if n <= MASK_SLICE:
        return pack_bits(flat <= 0)
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=out.device)
    for start in range(0, n, MASK_SLICE):
        part = flat[start : start + MASK_SLICE]
        pack_bits(part <= 0, out=bits[start // 8 : (start + part.numel() + 7) // 8])
    return bits


def zero_flagged_sliced(values: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """:func:`zero_flagged`, a slice at a time into one result: the same values, with the
    flags' temporaries (a byte and a value's width per element) a slice's."""
    n = values.numel()
    if n <= MASK_SLICE:
        return zero_flagged(values, bits)
    flat = values.reshape(-1)
    result = torch.empty(n, dtype=values.dtype, device=values.device)
    for start in range(0, n, MASK_SLICE):
        stop = min(start + MASK_SLICE, n)
        result[start:stop] = zero_flagged(flat[start:stop], bits[start // 8 : (stop + 7) // 8])
    return result.view(values.shape)


def zero_flagged(values: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``values.masked_fill(flags, 0)`` for the flags packed in ``bits``, without a branch (a
    random mask defeats the CPU's predictor): one AND of the bit patterns with a mask per value."""
    words = _flag_words(bits)
    words.bitwise_not_()  # high bit of each byte: the flag is clear (the value passes)
    words >>= 7
    words &= _SPREAD
    words *= 0xFF  # passes -> 0xFF, flagged -> 0 (no byte carries)
    # Read as int8, 0xFF is -1, and widening keeps it all ones.
    flags = words.view(torch.int8).reshape(-1)[: values.numel()]
    keep = flags.to(SAME_WIDTH_INT[values.element_size()])
    return (values.view(keep.dtype) & keep.view(values.shape)).view(values.dtype)


@functools.cache
def _byte_tables(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(set bits of each byte value; for each byte value and bit j, 1 + the set bits below j
    where bit j is set, and a large negative number where it is not)."""
    never = torch.iinfo(dtype).min + 1
    rows = [
        [(b & ((1 << j) - 1)).bit_count() + 1 if b >> j & 1 else never for j in range(8)]
        for b in range(256)
    ]
    return (
        torch.tensor([b.bit_count() for b in range(256)], dtype=dtype, device=device),
        torch.tensor(rows, dtype=dtype, device=device),
    )


def _index_dtype(top: int) -> torch.dtype:
    """int32 indices where the largest one, ``top``, fits (half the bytes), else int64."""
    return torch.int32 if top < torch.iinfo(torch.int32).max else torch.int64


def _set_per_byte(bits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mask bytes as table indices, how many flags each byte has set, as ``dtype``)."""
    as_index = bits.to(torch.int32)
    return as_index, _byte_tables(bits.device, dtype)[0].index_select(0, as_index)


def bit_positions(
    bits: torch.Tensor, n: int, base: int | torch.Tensor = 0, total: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the first ``n`` flags in ``bits``: ``base`` + 1 + the flags set before it where
    it is set, else 0 (indices into ``cat([0], kept)``), and the next slice's base on the device.
    Per byte, by tables and a prefix sum over bytes; ``total`` (the largest index) picks int32."""
    dtype = _index_dtype(base + n if total is None else total)
    as_index, per_byte = _set_per_byte(bits, dtype)
    start = torch.cumsum(per_byte, 0, dtype=dtype)
    end = (start[-1] if start.numel() else start.new_zeros(())) + base
    start -= per_byte - base  # exclusive: the flags set in earlier bytes, plus base
    pos = _byte_tables(bits.device, dtype)[1].index_select(0, as_index)
    pos += start.unsqueeze(1)  # unset flags stay far below zero
    return pos.view(-1)[:n].clamp_min_(0), end


@functools.cache
def _select_table(device: torch.device) -> torch.Tensor:
    """Entry 8 * b + r: the position in byte value b of its r-th set bit (0 past the last)."""
    rows = []
    for b in range(256):
        set_bits = [j for j in range(8) if b >> j & 1]
        rows += set_bits + [0] * (8 - len(set_bits))
    return torch.tensor(rows, dtype=torch.int32, device=device)


def kept_indices(bits: torch.Tensor) -> torch.Tensor:
    """The positions of the set flags in ``bits``, ascending: ``nonzero`` over the non-empty bytes
    only (8x fewer), then gathers; int32 where they fit."""
    dtype = _index_dtype(8 * bits.numel())
    as_index, per_byte = _set_per_byte(bits, dtype)
    nonempty = torch.nonzero(per_byte).squeeze(1)
    if nonempty.numel() == 0:
        return torch.empty(0, dtype=dtype, device=bits.device)
    per_nonempty = per_byte.index_select(0, nonempty)
    start = torch.cumsum(per_nonempty, 0, dtype=dtype)
    count = int(start[-1])
    start -= per_nonempty  # each non-empty byte's first output slot
    mark = torch.zeros(count, dtype=dtype, device=bits.device)
    mark.index_fill_(0, start[1:].long(), 1)
    ordinal = torch.cumsum(mark, 0, dtype=dtype)  # output slot -> which non-empty byte
    del mark
    # 8 * byte value - first slot, per non-empty byte: + the slot gives the select-table entry.
    code = as_index.index_select(0, nonempty).to(dtype) * 8 - start
    code = code.index_select(0, ordinal)
    code += torch.arange(count, dtype=dtype, device=bits.device)
    out = nonempty.to(dtype).mul_(8).index_select(0, ordinal)
    out += _select_table(bits.device).index_select(0, code)
    return out


def scatter_kept(
    bits: torch.Tensor | None,
    kept: torch.Tensor,
    n: int,
    slice_len: int,
    slice_bits: Callable[[int, int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The dense flat tensor of n elements whose set flags take ``kept`` in order, zeros elsewhere,
    a slice of flags at a time by one ``index_select``, no host read. ``slice_bits(start,
    length)``: each slice's flags instead of ``bits`` (flags past ``kept`` rebuild as zeros)."""
    slots = kept.numel()
    # Index 0, and slots + 1 (flags past the last slot, when flags are rebuilt), read a zero.
    zero = kept.new_zeros(1)
    padded = torch.cat([zero, kept] if slice_bits is None else [zero, kept, zero])
    dense = torch.empty(n, dtype=kept.dtype, device=kept.device)
    top = slots + 1 if slice_bits is None else max(slots, n) + 1  # the largest index that occurs
    base: int | torch.Tensor = 0
    for start in range(0, n, slice_len):
        length = min(slice_len, n - start)
        if slice_bits is None:
            piece = bits[start // 8 : (start + length + 7) // 8]
        else:
            piece = slice_bits(start, length)
        pos, base = bit_positions(piece, length, base, total=top)
        if slice_bits is not None:
            pos.clamp_max_(slots + 1)
        torch.index_select(padded, 0, pos, out=dense[start : start + length])
    return dense


def compact_into(
    values: torch.Tensor,
    mask: torch.Tensor,
    out: torch.Tensor,
    base: torch.Tensor,
    flags: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Write ``values[mask]`` (flat) into ``out`` from slot ``base`` (a 0-dim int64 tensor) on,
    no size from the data (no host wait); what does not fit goes to ``out``'s last slot, unread.
    Returns (with ``flags``, which values were stored; the next base; how many ``mask`` flagged)."""
    length, capacity, dev = values.numel(), out.numel() - 1, values.device
    # + a slot that the positions past the capacity set
    stored_flags = torch.zeros(length + 1, dtype=torch.bool, device=dev) if flags else None
    flagged = torch.count_nonzero(mask)
    size = min(length, capacity)
    if size == 0:
        return (None if stored_flags is None else stored_flags[:length]), base, flagged
    # The first `size` flagged positions in order, then -1: a fixed-size output.
    idx = torch.nonzero_static(mask, size=size, fill_value=-1).squeeze(1)
    kept = values.index_select(0, idx.clamp_min(0))
    stored = torch.minimum((capacity - base).clamp_min_(0), flagged)  # how many of them fit
    slot = torch.arange(size, dtype=torch.int32, device=dev)
    skip = slot >= stored
    slot += base
    out.index_put_((slot.masked_fill_(skip, capacity),), kept)
    if stored_flags is None:
        return None, base + stored, flagged
    stored_flags.index_fill_(0, idx.masked_fill_(skip, length), True)
    return stored_flags[:length], base + stored, flagged


def compact_bits(values: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``values[unpack_bits(bits, n)]`` for a flat tensor of n values: the CPU's compaction when
    the mask is packed anyway (faster than a boolean index: :func:`kept_indices`)."""
    return values.index_select(0, kept_indices(bits))
