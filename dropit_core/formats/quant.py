"""quant's pack format, specified once, and its eager reference: what every path writes.

A pack of ``n`` values read as ``dtype`` (a layer's fp32 input, or the bf16/fp16 values an autocast
op computed with), in groups of ``group`` consecutive values (the last may be shorter), is three
tensors, in this order in :class:`dropit_core.formats.packed.Packed` (``values, scales, mins``):

- ``values``: uint8[:func:`code_bytes` (n, bits)], the codes packed ``8 // bits`` per byte, the
  first in the low bits; a last partial byte is padded with zero codes. A group's codes start on
  a byte when ``group % (8 // bits) == 0`` (:func:`whole_bytes`): the only groups the C loops
  and the Triton kernels take; others pack eagerly, in the same format.
- ``scales``: fp32[groups], the group's step: ``max((max - min) * inv_levels(bits), tiny)``,
  ``inv_levels`` the fp32 rounding of ``1 / (2**bits - 1)``, ``tiny`` fp32's smallest normal.
- ``mins``: fp32[groups], the group's minimum.

Code of element ``i``: ``floor(min((x - min) / step + u_i, 2**bits - 1))``, ``u_i`` its draw,
:func:`dropit_core.formats.seeds.hash_bits` ``(seed, i) * 2**-24``. Rebuilt: ``code * step + min``
in fp32, then cast to ``dtype``. No fused multiply-add anywhere.

The C loops and the Triton kernels are tested byte for byte against this module; the fused
traced pack is :func:`quantize` itself.
"""

from __future__ import annotations

import torch

from dropit_core.formats import packed as base
from dropit_core.formats.bits import pack_low_bits
from dropit_core.formats.packed import tiny
from dropit_core.formats.seeds import UNIFORM_BITS, keyed_bits

# Codes per byte -> the integer of that many bytes, and unpack_codes' shifts.
_WORDS = {2: (torch.int16, (4,)), 4: (torch.int32, (6, 12, 18))}


def code_bytes(elements: int, bits: int) -> int:
    """Bytes that ``elements`` codes of ``bits`` bits take, packed (``bits.pack_low_bits``)."""
    return (elements * bits + 7) // 8


def inv_levels(bits: int) -> float:
    """1 / (2**bits - 1) rounded to fp32: quant's step is ``(max - min) * inv_levels(bits)``."""
    return _INV_LEVELS[bits]


# Made once: per pack a torch.tensor was host time, and the traced pack reads a constant.
_INV_LEVELS = {b: float(torch.tensor(1.0 / ((1 << b) - 1), dtype=torch.float32)) for b in (2, 4, 8)}


def whole_bytes(bits: int, group: int) -> bool:
    """Whether each group's codes fill whole bytes (what the C loops and kernels take)."""
    return group % (8 // bits) == 0


def slice_len(group: int) -> int:
    """Elements per slice of the eager path: whole groups and whole code bytes."""
    return group * 8 * max(1, base.SLICE // (group * 8))


def buffers(
    n: int, bits: int, group: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The final (codes, mins, scales) buffers of a pack of n values: every path writes once."""
    groups = -(-n // group)
    return (
        torch.empty(code_bytes(n, bits), dtype=torch.uint8, device=device),
        torch.empty(groups, dtype=torch.float32, device=device),
        torch.empty(groups, dtype=torch.float32, device=device),
    )


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``formats.bits.pack_low_bits``: the first ``n`` codes as a flat uint8 tensor.
    Each byte widened to a word and OR-ed with itself shifted left by j * (8 - bits): byte j of the
    word then holds code j in its low bits, which one mask keeps."""
    if bits == 8:
        return packed[:n]
    per_byte = 8 // bits
    word_dtype, shifts = _WORDS[per_byte]
    byte = packed.to(word_dtype)
    words = byte << shifts[0]
    words |= byte
    for shift in shifts[1:]:
        words |= byte << shift
    words &= int.from_bytes(bytes([(1 << bits) - 1] * per_byte), "little")
    return words.view(torch.uint8)[:n]


def pack_eager(
    flat: torch.Tensor,
    keys: tuple[int, int],
    bits: int,
    group: int,
    cast: torch.dtype | None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """The reference pack of ``flat`` (read as ``cast`` values where given) into the buffers
    ``out`` (codes, mins, scales), slice by slice; ``keys``: ``seeds.hash_keys(seed)``."""
    codes, mins, scales = out
    step = slice_len(group)
    for start in range(0, flat.numel(), step):
        piece = flat[start : start + step]
        length = piece.numel()
        code = piece.new_empty(length, dtype=torch.uint8)  # a byte per code, then packed
        noise = keyed_bits(keys, start, length, piece.device)
        for at, width, groups in _group_rows(start, length, group):
            rows = piece[at].view(-1, width)
            code[at], mins[groups], scales[groups] = quantize(rows, noise[at], bits, cast)
        pack_low_bits(code, bits, codes[start * bits // 8 : code_bytes(start + length, bits)])


def _group_rows(start: int, length: int, group: int) -> list[tuple[slice, int, slice]]:
    """How ``length`` values from element ``start`` (on a group's first value) lie in groups:
    the whole groups as rows, then a last partial group (its range is its own), each as (the
    values' slice within the range, the row width, the groups' slice in the pack)."""
    whole = length // group * group
    g0 = start // group
    parts = []
    for lo, hi in ((0, whole), (whole, length)):
        if hi > lo:
            width = min(group, hi - lo)
            r0 = g0 + lo // group
            parts.append((slice(lo, hi), width, slice(r0, r0 + (hi - lo) // width)))
    return parts


def quantize(
    rows: torch.Tensor, noise: torch.Tensor, bits: int, cast: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the codes of ``rows``, one group a row, flat, a byte each; the groups' minima; their
    steps), ``noise`` the rows' draws (``seeds.keyed_bits``): the kernels' fp32 operations in
    their order, as torch ops that Inductor fuses. ``cast``: read as that dtype's values."""
    g = (rows if cast is None else rows.to(cast)).float()
    # Two reductions, not aminmax: over rows of a group, torch's CPU aminmax was 9x slower.
    mins = g.amin(1)
    # Times the fp32 1/levels, not divided by levels: CUDA's torch turns a division by a
    # scalar into that product anyway, and the kernels compute it alike everywhere.
    scales = (g.amax(1) - mins).mul_(inv_levels(bits)).clamp_min_(tiny(torch.float32))
    y = torch.sub(g, mins[:, None]).div_(scales[:, None])  # in [0, levels]: the exact code
    # floor(y + u), u = noise * 2**-24 (exact): y rounded up with probability equal to its
    # remainder. y + u >= 0, so the integer cast's truncation is the floor; clamping first
    # gives what the kernel's floor-then-clamp gives. In place: one slice's temporaries.
    y.add_(noise.view_as(y), alpha=2.0**-UNIFORM_BITS).clamp_max_((1 << bits) - 1)
    # Via int16 (the same truncation, every code fits): torch's CPU float -> uint8 cast is
    # several times slower than float -> int16 and int16 -> uint8 together.
    return y.view(-1).to(torch.int16).to(torch.uint8), mins, scales


def fields(
    packed: base.Packed, start: int, stop: int, bits: int, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of the codes, minimums and steps of elements ``[start, stop)`` of ``packed``
    (``start`` on a whole group and code byte)."""
    first, last = start // group, -(-stop // group)
    values = packed.values[start * bits // 8 : code_bytes(stop, bits)]
    return values, packed.mins[first:last], packed.scales[first:last]


def rebuild_eager(
    packed: base.Packed, start: int, length: int, bits: int, group: int, dense: torch.Tensor
) -> None:
    """The reference rebuild of ``length`` values from element ``start`` (on a whole group and
    byte) into ``dense``."""
    codes = packed.values[start * bits // 8 : code_bytes(start + length, bits)]  # only the codes
    code = unpack_codes(codes, bits, length)
    # fp32 output: rebuilt in place in its final buffer; narrower: via an fp32 slice.
    out = dense[start : start + length]
    values = out if out.dtype == torch.float32 else torch.empty_like(out, dtype=torch.float32)
    values.copy_(code)
    for at, width, groups in _group_rows(start, length, group):
        rows = values[at].view(-1, width)
        rows.mul_(packed.scales[groups, None]).add_(packed.mins[groups, None])
    if values is not out:
        out.copy_(values)
