"""The element-wise packs' compaction and rebuild in Triton, the eager fixed-capacity path's bytes
(:mod:`dropit_core.strategies.elementwise`): a count of each block's kept elements (its
:class:`~dropit_core.formats.keep_rule.KeepRule`), their exclusive cumulative sum on the device,
and one launch writing each block's values at those offsets with its mask; the rebuild alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dropit_core.backends.triton.launch import cdiv
from dropit_core.backends.triton.noise import uniform
from dropit_core.formats.keep_rule import DRAW, TIES, KeepRule
from dropit_core.formats.seeds import hash_keys

BLOCK = 4096  # elements per program: a multiple of 8, so each program writes whole mask bytes


@triton.jit
def _choose(x, idx, t_ptr, key_low, key_high, gamma, RULE: tl.constexpr):
    """(kept, tie) flags of one block; ``tie`` only means something for the TIES rule."""
    a = tl.abs(x)
    tie = a < 0  # all false (|x| never is, NaN neither), of the right shape
    if RULE == 0:  # AT_LEAST: |x| >= t, compared in the input's dtype as torch does
        keep = a >= tl.load(t_ptr)
    elif RULE == 1:  # TIES: |x| > t; the ties are ranked by the caller
        t = tl.load(t_ptr)
        keep = a > t
        tie = a == t
    elif RULE == 2:  # DRAW: u >= gamma (gamma rounded to fp32, as torch compares it)
        keep = uniform(key_low, key_high, idx) >= gamma
    else:  # IMPORTANCE: |x| > u tau, in fp32
        keep = a.to(tl.float32) > uniform(key_low, key_high, idx) * tl.load(t_ptr)
    return keep, tie


@triton.jit
def _block(x_ptr, pid, n, t_ptr, key_low, key_high, gamma, RULE: tl.constexpr, BLOCK: tl.constexpr):
    """Block ``pid``'s (indices, in range, values, kept, tie) flags, the values read once."""
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n
    x = tl.load(x_ptr + idx, mask=ok, other=0.0)
    keep, tie = _choose(x, idx, t_ptr, key_low, key_high, gamma, RULE)
    return idx, ok, x, keep, tie


@triton.jit(do_not_specialize=["key_low", "key_high", "gamma"])
def _count_kernel(
    x_ptr, t_ptr, counts_ptr, ties_ptr, n, key_low, key_high, gamma,
    RULE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    idx, ok, x, keep, tie = _block(x_ptr, pid, n, t_ptr, key_low, key_high, gamma, RULE, BLOCK)
    tl.store(counts_ptr + pid, tl.sum((keep & ok).to(tl.int32), axis=0))
    if RULE == 1:
        tl.store(ties_ptr + pid, tl.sum((tie & ok).to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["key_low", "key_high", "gamma"])
def _compact_kernel(
    x_ptr, t_ptr, left_ptr, starts_ptr, tie_starts_ptr, values_ptr, bits_ptr, n, capacity,
    key_low, key_high, gamma, RULE: tl.constexpr, WRITE_BITS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    idx, ok, x, keep, tie = _block(x_ptr, pid, n, t_ptr, key_low, key_high, gamma, RULE, BLOCK)
    if RULE == 1:  # a tie is kept while its rank in flat order is within the budget
        tie = tie & ok
        rank = tl.load(tie_starts_ptr + pid) + tl.cumsum(tie.to(tl.int64), axis=0)
        keep = keep | (tie & (rank <= tl.load(left_ptr)))
    keep = keep & ok
    slot = tl.load(starts_ptr + pid) + tl.cumsum(keep.to(tl.int64), axis=0) - 1
    stored = keep & (slot < capacity)
    tl.store(values_ptr + slot, x, mask=stored)
    if WRITE_BITS:
        flags = tl.where(stored, 1, 0)
        shifts = tl.arange(0, 8)
        byte = tl.sum(tl.reshape(flags, (BLOCK // 8, 8)) << shifts[None, :], axis=1)
        bidx = pid.to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        tl.store(bits_ptr + bidx, byte.to(tl.uint8), mask=bidx < (n + 7) // 8)


@triton.jit
def _flags(bits_ptr, idx, ok, key_low, key_high, gamma, FROM_DRAW: tl.constexpr):
    """A block's flags: read from the mask bytes, or drawn again from the pack's seed."""
    if FROM_DRAW:
        flag = uniform(key_low, key_high, idx) >= gamma
    else:
        byte = tl.load(bits_ptr + idx // 8, mask=ok, other=0).to(tl.int32)
        flag = ((byte >> (idx % 8).to(tl.int32)) & 1) != 0
    return flag & ok


@triton.jit(do_not_specialize=["key_low", "key_high", "gamma"])
def _flag_count_kernel(
    bits_ptr, counts_ptr, n, key_low, key_high, gamma,
    FROM_DRAW: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    flag = _flags(bits_ptr, idx, idx < n, key_low, key_high, gamma, FROM_DRAW)
    tl.store(counts_ptr + pid, tl.sum(flag.to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["key_low", "key_high", "gamma"])
def _scatter_kernel(
    bits_ptr, values_ptr, starts_ptr, out_ptr, n, slots, key_low, key_high, gamma,
    FROM_DRAW: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n
    flag = _flags(bits_ptr, idx, ok, key_low, key_high, gamma, FROM_DRAW)
    slot = tl.load(starts_ptr + pid) + tl.cumsum(flag.to(tl.int64), axis=0) - 1
    take = flag & (slot < slots)  # flags drawn past the last slot rebuild as zeros
    v = tl.load(values_ptr + slot, mask=take, other=0)
    tl.store(out_ptr + idx, v, mask=ok)


def _starts(counts: torch.Tensor) -> torch.Tensor:
    """Exclusive cumulative sum (int64): where each block's values start."""
    return torch.cumsum(counts, 0, dtype=torch.int64) - counts


def _check_block(block: int) -> None:
    if block % 8 or block & (block - 1):
        raise ValueError(f"compact block {block} is not a power of two of at least 8")


def compact_pack(
    flat: torch.Tensor, rule: KeepRule, slots: int, write_bits: bool = True, block: int = BLOCK
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(the packed flags of the stored elements or None, a buffer of ``slots`` values, how many
    the rule chose: a 0-dim int64 tensor) for a flat float tensor; the eager fixed-capacity pack's
    bytes. Slots past the stored values hold zeros. ``block`` changes no byte."""
    if flat.dim() != 1 or not flat.is_floating_point():
        raise ValueError(f"compact_pack takes a flat float tensor, got {flat.shape} {flat.dtype}")
    _check_block(block)
    if flat.numel() > 1 << 44:
        raise ValueError("the element-wise kernels draw for element indices below 2**44")
    flat = flat.contiguous()
    n, dev = flat.numel(), flat.device
    values = torch.zeros(slots + 1, dtype=flat.dtype, device=dev)  # + a slot for an empty pack
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=dev) if write_bits else None
    if n == 0:
        return bits, values[:slots], torch.zeros((), dtype=torch.int64, device=dev)
    blocks = cdiv(n, block)
    counts = torch.empty(blocks, dtype=torch.int32, device=dev)
    ties = torch.empty(blocks if rule.kind == TIES else 1, dtype=torch.int32, device=dev)
    t = rule.threshold if rule.threshold is not None else values  # a pointer the rule never reads
    keys = hash_keys(rule.seed) if rule.seed is not None else (0, 0)
    _count_kernel[(blocks,)](
        flat, t, counts, ties, n, *keys, rule.gamma, RULE=rule.kind, BLOCK=block
    )
    if rule.kind == TIES:
        left = rule.left.reshape(1).to(torch.int64)
        tie_starts = _starts(ties)
        # what each block keeps: its values above t, then its ties still within the budget
        kept = counts + (left - tie_starts).clamp(min=0).minimum(ties)
    else:
        left, tie_starts, kept = counts, counts, counts  # placeholders the kernel never reads
    starts = _starts(kept)
    _compact_kernel[(blocks,)](
        flat, t, left, starts, tie_starts, values, bits if write_bits else values, n, slots,
        *keys, rule.gamma, RULE=rule.kind, WRITE_BITS=write_bits, BLOCK=block,
    )  # fmt: skip
    return bits, values[:slots], kept.sum(dtype=torch.int64)


def scatter_pack(
    bits: torch.Tensor | None,
    values: torch.Tensor,
    n: int,
    draw: KeepRule | None = None,
    block: int = BLOCK,
) -> torch.Tensor:
    """``dropit_core.formats.bits.scatter_kept``'s dense flat tensor of n elements: ``values`` in
    the flagged places, in order, zeros elsewhere; the flags from ``bits``, or drawn again by
    ``draw`` (a DRAW rule) when the pack stores none."""
    _check_block(block)
    if (bits is None) == (draw is None):
        raise ValueError("scatter_pack takes packed flags or a draw, one of them")
    if draw is not None and draw.kind != DRAW:
        raise ValueError(f"scatter_pack redraws flags of a DRAW rule only, got kind {draw.kind}")
    values = values.contiguous()
    out = torch.empty(n, dtype=values.dtype, device=values.device)
    if n == 0:
        return out
    slots = values.numel()
    if slots == 0:  # nothing stored: every flag rebuilds as a zero
        return out.zero_()
    blocks = cdiv(n, block)
    counts = torch.empty(blocks, dtype=torch.int32, device=values.device)
    keys, gamma = (hash_keys(draw.seed), draw.gamma) if draw is not None else ((0, 0), 0.0)
    src = bits if bits is not None else values  # a pointer FROM_DRAW never reads
    from_draw = draw is not None
    _flag_count_kernel[(blocks,)](src, counts, n, *keys, gamma, FROM_DRAW=from_draw, BLOCK=block)
    _scatter_kernel[(blocks,)](
        src, values, _starts(counts), out, n, slots, *keys, gamma,
        FROM_DRAW=from_draw, BLOCK=block,
    )  # fmt: skip
    return out
