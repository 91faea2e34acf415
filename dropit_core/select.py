"""The exact k-th largest magnitude of a large tensor, with small temporaries and no host sync.

The published DropIT takes it with one ``kthvalue`` over a dense ``|x|`` copy: a full-size
temporary (two for bf16, copied to fp32) and, on CUDA, one thread block for the whole tensor.
Here a strided sample brackets the k-th value; one pass, slice by slice, counts the elements
above the bracket and gathers the few inside it (a few percent of n); sorting those gives the
exact value. Should the sample mislead (a miss is reported, not hidden), a radix select on the
bit patterns of ``|x|`` finds it exactly in two histogram passes.

Both return the value floored at the dtype's smallest normal number, so that keeping
``|x| >= value`` never keeps exact zeros (they rebuild as zeros anyway).

On the CPU the counting pass gathers every value at or above the bracket's low end, a superset of
the k largest (:func:`select_superset`): min-k packs its kept values from it instead of reading
the input a third time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from .packing import compact_bits, pack_bits

# Tensors up to this size are simply sorted: the sort is as small as the sample would be.
DIRECT = 1 << 16
SAMPLE = 1 << 16
# Bracket half-width in standard deviations of the sample's rank, plus a few ranks of slack.
# A strided sample of a feature map is not i.i.d., so the spread is generous; it costs only a
# wider gather (about 2 * 8 * sqrt(p (1-p) / 65536) of n: 2.5% at p = 0.2).
_SPREAD = 8.0
_SLACK = 16
# On CUDA each slice gathers into a fixed-size buffer (no host sync): this many times its
# expected share of the bracket, plus a floor; a slice that overflows it is reported as a miss.
CAP_FACTOR = 4.0
CAP_FLOOR = 1024

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def prime_at_least(n: int) -> int:
    """Smallest prime >= n (n is small here: numel / sample size)."""
    candidate = max(2, n)
    while any(candidate % d == 0 for d in range(2, math.isqrt(candidate) + 1)):
        candidate += 1
    return candidate


def sample_stride(n: int, sample: int) -> int:
    """Stride of a ~``sample``-element strided view of n elements: 1 or an odd prime.

    An odd prime stride shares no factor with the power-of-two widths of CNN feature maps, so
    the sample does not lock onto columns.
    """
    stride = n // sample
    return 1 if stride <= 1 else prime_at_least(max(3, stride))


def tiny(dtype: torch.dtype) -> float:
    """The smallest normal number of ``dtype``: the floor of every magnitude threshold."""
    return torch.finfo(dtype).tiny


def largest(values: torch.Tensor, ranks: Sequence[int]) -> list[torch.Tensor]:
    """The ``r``-th largest of a 1-D tensor (0-based, counted from the top) for each ``r``.

    On the CPU one quickselect (``kthvalue``, O(m)) per rank: ten times cheaper than sorting a
    64Ki sample, which was most of a small layer's selection cost. On CUDA ``kthvalue`` runs one
    thread block for the whole tensor, so a sort that uses the device is faster there.
    """
    m = values.numel()
    if values.device.type == "cpu":
        return [torch.kthvalue(values, m - r).values for r in ranks]
    ordered = torch.sort(values, descending=True).values
    return [ordered[r] for r in ranks]


class Bracket(NamedTuple):
    """Where a strided sample puts the k-th largest ``|x|``: in ``[lo, hi]`` with high odds."""

    lo: torch.Tensor  # floored at the smallest normal number
    hi: torch.Tensor  # +inf when the bracket reaches the largest sampled value
    floored: torch.Tensor  # lo was raised to the smallest normal: "t <= tiny" is an answer
    share: float  # the fraction of elements expected inside


def bracket(flat: torch.Tensor, k: int) -> Bracket:
    """Bracket the k-th largest ``|flat|`` from a ~64Ki strided sample (no host sync)."""
    n = flat.numel()
    dev = flat.device
    floor = tiny(flat.dtype)
    sample = flat[:: sample_stride(n, SAMPLE)].abs()
    m = sample.numel()
    p = k / n
    margin = _SPREAD * math.sqrt(m * p * (1.0 - p)) + _SLACK
    r_hi, r_lo = math.floor(p * m - margin), math.ceil(p * m + margin)
    ranks = [r for r in (r_hi, r_lo) if 0 <= r < m]
    picked = dict(zip(ranks, largest(sample, ranks), strict=True))
    hi = picked.get(r_hi, torch.full((), math.inf, dtype=flat.dtype, device=dev))
    lo_raw = picked.get(r_lo, torch.zeros((), dtype=flat.dtype, device=dev))
    share = (min(r_lo, m - 1) - max(r_hi, -1) + 1) / m
    return Bracket(lo_raw.clamp_min(floor), hi, lo_raw <= floor, share)


def kth_from_candidates(
    magnitudes: torch.Tensor, above: int, k: int, b: Bracket
) -> torch.Tensor | None:
    """The k-th largest from the bracket's candidates (host-side counts); None on a miss.

    ``magnitudes`` are all the |x| inside ``[lo, hi]`` and ``above`` the count above ``hi``.
    """
    rank = k - above  # of the k-th largest among the candidates, 1-based, descending
    if 1 <= rank <= magnitudes.numel():
        t = torch.kthvalue(magnitudes, magnitudes.numel() - rank + 1).values
        return t.clamp_min(tiny(magnitudes.dtype))
    if rank >= 1 and bool(b.floored):
        return torch.full_like(b.lo, tiny(b.lo.dtype))
    return None


def kth_largest_abs(
    flat: torch.Tensor, k: int, slice_len: int, static: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, ok): t the k-th largest ``|flat|`` (1 <= k <= n) floored at the smallest normal.

    ``ok`` is a 0-dim bool tensor; when it is False the bracket missed and ``t`` is meaningless:
    call :func:`radix_kth_largest_abs`. With ``static`` nothing here waits for the device (fixed
    buffers instead of data-dependent shapes), so the caller can read ``ok`` with its own sync.
    """
    n = flat.numel()
    dev = flat.device
    if n <= DIRECT:
        t = largest(flat.abs(), [k - 1])[0].clamp_min(tiny(flat.dtype))
        return t, torch.ones((), dtype=torch.bool, device=dev)
    if static:
        return _scan_static(flat, k, slice_len, bracket(flat, k))
    t = select_superset(flat, k, slice_len).t
    ok = torch.full((), t is not None, dtype=torch.bool, device=dev)
    return (t if t is not None else torch.zeros((), dtype=flat.dtype, device=dev)), ok


class Superset(NamedTuple):
    """The k-th largest ``|x|`` and, slice by slice, every value at or above the bracket's low
    end (signed, in order): a superset of the kept values that a pack filters them from."""

    t: torch.Tensor | None  # floored at the smallest normal; None when the sample misled
    values: list[torch.Tensor]


def select_superset(flat: torch.Tensor, k: int, slice_len: int) -> Superset:
    """Bracket the k-th largest ``|flat|``, gather the values at or above the bracket slice by
    slice, and find the exact k-th value among them (the CPU path: host-side counts)."""
    b = bracket(flat, k)
    values = [
        compact_bits(flat[start : start + slice_len], pack_bits(a >= b.lo))
        for start, a in zip(
            range(0, flat.numel(), slice_len), abs_slices(flat, slice_len), strict=True
        )
    ]
    above, candidates = 0, []
    for v in values:  # slice by slice: no superset-sized temporary
        m = v.abs()
        inside = m[m <= b.hi]  # the rest of the superset (all >= lo) lies above hi
        above += m.numel() - inside.numel()
        candidates.append(inside)
    return Superset(kth_from_candidates(torch.cat(candidates), above, k, b), values)


def abs_slices(flat: torch.Tensor, slice_len: int) -> Iterator[torch.Tensor]:
    """|x| slice by slice in one reused buffer (a fresh one per slice costs page faults)."""
    buf = torch.empty(min(slice_len, flat.numel()), dtype=flat.dtype, device=flat.device)
    for start in range(0, flat.numel(), slice_len):
        piece = flat[start : start + slice_len]
        yield torch.abs(piece, out=buf[: piece.numel()])


def _scan_static(
    flat: torch.Tensor, k: int, slice_len: int, b: Bracket
) -> tuple[torch.Tensor, torch.Tensor]:
    """The counting pass without host syncs: each slice gathers into a fixed-size buffer."""
    lo, hi, floored, share = b
    dev = flat.device
    floor = tiny(flat.dtype)
    above = torch.zeros((), dtype=torch.int64, device=dev)
    inside_count = torch.zeros((), dtype=torch.int64, device=dev)
    overflow = torch.zeros((), dtype=torch.bool, device=dev)
    parts = []
    for a in abs_slices(flat, slice_len):
        above += torch.count_nonzero(a > hi)
        inside = (a >= lo) & (a <= hi)
        count = torch.count_nonzero(inside)
        cap = min(a.numel(), math.ceil(a.numel() * share * CAP_FACTOR) + CAP_FLOOR)
        idx = torch.nonzero_static(inside, size=cap, fill_value=-1).squeeze(1)
        # -1 pads the buffer: below every magnitude, so it sorts last.
        parts.append(torch.where(idx >= 0, a[idx.clamp_min(0)], -1))
        inside_count += count
        overflow |= count > cap
    # A multi-block sort on CUDA (kthvalue would run one block), of a few percent of n.
    candidates = torch.sort(torch.cat(parts), descending=True).values
    rank = k - 1 - above  # of the k-th largest among the candidates, 0-based, descending
    in_bracket = (rank >= 0) & (rank < inside_count)
    # index_select, not candidates[rank]: a 0-dim index would be read on the host (a sync).
    at = rank.clamp(0, candidates.numel() - 1).view(1)
    picked = candidates.index_select(0, at).squeeze(0)
    t = torch.where(in_bracket, picked, torch.full_like(lo, floor)).clamp_min(floor)
    return t, (rank >= 0) & (in_bracket | floored) & ~overflow


def radix_kth_largest_abs(flat: torch.Tensor, k: int, slice_len: int) -> torch.Tensor:
    """The k-th largest ``|flat|`` floored at the smallest normal, exactly, by radix select.

    Non-negative floats order as their bit patterns do, so histograms of the high then the low
    16 bits pin the value down (one pass for 16-bit floats). Temporaries are one slice and 64Ki
    counters; it syncs with the host per level, which is fine for a fallback.
    """
    floor = tiny(flat.dtype)
    bits_dtype = _BITS.get(flat.dtype)
    if bits_dtype is None:  # float64: not used by detectors; a sort is exact
        return torch.sort(flat.abs(), descending=True).values[k - 1].clamp_min(floor)
    width = torch.iinfo(bits_dtype).bits
    shifts = (16, 0) if width == 32 else (0,)
    prefix, remaining = 0, k
    for level, shift in enumerate(shifts):
        hist = torch.zeros(1 << 16, dtype=torch.int64, device=flat.device)
        for start in range(0, flat.numel(), slice_len):
            b = flat[start : start + slice_len].abs().view(bits_dtype).to(torch.int32)
            if level:
                b = b[(b >> (shift + 16)) == prefix]
            hist += torch.bincount((b >> shift) & 0xFFFF, minlength=1 << 16)
        at_least = hist.flip(0).cumsum(0)  # at_least[j]: count in buckets >= 65535 - j
        j = int(torch.searchsorted(at_least, remaining).item())
        bucket = 65535 - j
        remaining -= int(at_least[j].item()) - int(hist[bucket].item())
        prefix = (prefix << 16) | bucket
    value = torch.tensor([prefix], dtype=torch.int64).to(bits_dtype).view(flat.dtype)
    return value[0].to(flat.device).clamp_min(floor)
