"""The exact k-th largest magnitude of a large tensor, with small temporaries (the published
DropIT's ``kthvalue`` over a dense ``|x|`` copy makes a full-size one).

On the CPU (:func:`select_superset`) a strided sample brackets the k-th value; one pass gathers
every value at or above the bracket's low end, and sorting the few inside it gives the exact
value (min-k packs from that superset). Should the sample mislead, a radix select finds it. On an
accelerator (:func:`kth_largest_abs`) the radix select (:func:`radix_kth_largest_abs`) runs
alone: sizes fixed by the shape, no host wait. Both floor the value at the dtype's smallest
normal, so that keeping ``|x| >= value`` never keeps exact zeros.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from dropit_core.backends import dispatch
from dropit_core.formats.bits import compact_bits, pack_bits
from dropit_core.formats.packed import tiny

# Tensors up to this size are simply sorted: the sort is as small as the sample would be.
DIRECT = 1 << 16
SAMPLE = 1 << 16
# Bracket half-width in standard deviations of the sample's rank, plus a few ranks of slack.
# A strided sample of a feature map is not i.i.d., so the spread is generous; it costs only a
# wider gather (about 2 * 8 * sqrt(p (1-p) / 65536) of n: 2.5% at p = 0.2).
_SPREAD = 8.0
_SLACK = 16

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def prime_at_least(n: int) -> int:
    """Smallest prime >= n (n is small here: numel / sample size)."""
    candidate = max(2, n)
    while any(candidate % d == 0 for d in range(2, math.isqrt(candidate) + 1)):
        candidate += 1
    return candidate


def sample_stride(n: int, sample: int) -> int:
    """Stride of a ~``sample``-element strided view of n elements: 1 or an odd prime (no factor
    shared with a feature map's power-of-two width: the sample does not lock onto columns)."""
    stride = n // sample
    return 1 if stride <= 1 else prime_at_least(max(3, stride))


def sample_size(n: int, sample: int) -> int:
    """How many elements the strided view ``flat[::sample_stride(n, sample)]`` holds."""
    return -(-n // sample_stride(n, sample)) if n else 0


def largest(values: torch.Tensor, ranks: Sequence[int]) -> list[torch.Tensor]:
    """The ``r``-th largest of a 1-D tensor (0-based) for each ``r``: on the CPU a ``kthvalue``
    per rank, on CUDA a sort (its ``kthvalue`` runs one thread block)."""
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


def bracket(flat: torch.Tensor, k: int) -> Bracket:
    """Bracket the k-th largest ``|flat|`` from a ~64Ki strided sample (no host sync)."""
    n, dev = flat.numel(), flat.device
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
    return Bracket(lo_raw.clamp_min(floor), hi, lo_raw <= floor)


def kth_from_candidates(
    magnitudes: torch.Tensor, above: int, k: int, b: Bracket
) -> torch.Tensor | None:
    """The k-th largest from the bracket's candidates (host-side counts); None on a miss.
    ``magnitudes`` are all the |x| inside ``[lo, hi]`` and ``above`` the count above ``hi``."""
    rank = k - above  # of the k-th largest among the candidates, 1-based, descending
    if 1 <= rank <= magnitudes.numel():
        t = torch.kthvalue(magnitudes, magnitudes.numel() - rank + 1).values
        return t.clamp_min(tiny(magnitudes.dtype))
    if rank >= 1 and bool(b.floored):
        return torch.full_like(b.lo, tiny(b.lo.dtype))
    return None


class KthLargest(NamedTuple):
    """The k-th largest ``|x|`` and how many of the elements equal to it the k largest hold."""

    value: torch.Tensor  # floored at the smallest normal
    ties: torch.Tensor  # int64, 0-dim: k - (elements above value); >= every tie when floored


def _kth(raw: torch.Tensor, ties: torch.Tensor, k: int) -> KthLargest:
    """Floor ``raw``; once floored every element at the floor is kept, so the ties are k."""
    floor = tiny(raw.dtype)
    ties = torch.where(raw < floor, k, ties.reshape(()).to(torch.int64))
    return KthLargest(raw.clamp_min(floor), ties)


def kth_largest_abs(flat: torch.Tensor, k: int, slice_len: int) -> KthLargest:
    """The k-th largest ``|flat|`` (1 <= k <= n), exactly, with no host read: a sort of a small
    (or float64) tensor, else :func:`radix_kth_largest_abs`."""
    if flat.numel() <= DIRECT or flat.dtype not in _BITS:
        a = flat.abs()
        raw = largest(a, [k - 1])[0]
        return _kth(raw, k - torch.count_nonzero(a > raw), k)
    return radix_kth_largest_abs(flat, k, slice_len)


class Superset(NamedTuple):
    """The k-th largest ``|x|`` and, slice by slice, every value at or above the bracket's low
    end (signed, in order): a superset of the kept values that a pack filters them from."""

    t: torch.Tensor | None  # floored at the smallest normal; None when the sample misled
    values: list[torch.Tensor]


def select_superset(flat: torch.Tensor, k: int, slice_len: int) -> Superset:
    """The CPU path of the module's docstring (host-side counts): the k-th value and superset."""
    b = bracket(flat, k)
    values = [
        compact_bits(flat[i * slice_len : (i + 1) * slice_len], pack_bits(a >= b.lo))
        for i, a in enumerate(abs_slices(flat, slice_len))
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


def _abs_bits_histogram(
    flat: torch.Tensor,
    bits_dtype: torch.dtype,
    shift: int,
    level: int,
    prefix: torch.Tensor,
    slice_len: int,
) -> torch.Tensor:
    """One histogram pass of :func:`radix_kth_largest_abs` in eager torch, slice by slice."""
    # The second level counts into the upper half the elements outside the chosen bucket:
    # they spread over its 64Ki counters instead of all hitting one.
    hist = torch.zeros(2 << 16 if level else 1 << 16, dtype=torch.int32, device=flat.device)
    ones = torch.ones(1, dtype=torch.int32, device=flat.device)
    for start in range(0, flat.numel(), slice_len):
        b = flat[start : start + slice_len].abs().view(bits_dtype).to(torch.int32)
        bucket = (b >> shift) & 0xFFFF
        if level:
            bucket += ((b >> (shift + 16)) != prefix).to(torch.int32) << 16
        hist.index_add_(0, bucket, ones.expand(bucket.numel()))
    return hist[: 1 << 16]


def radix_kth_largest_abs(flat: torch.Tensor, k: int, slice_len: int) -> KthLargest:
    """The k-th largest ``|flat|`` (1 <= k <= n), exactly, with no host read: non-negative floats
    order as their bit patterns, so histograms of the high then the low 16 bits pin it down, the
    bucket found on the device. Temporaries: one slice and 64Ki counters."""
    dev = flat.device
    bits_dtype = _BITS.get(flat.dtype)
    if bits_dtype is None:  # float64: not used by detectors; a sort is exact
        return kth_largest_abs(flat, k, slice_len)
    width = torch.iinfo(bits_dtype).bits
    shifts = (16, 0) if width == 32 else (0,)
    # Counters of int32: a slice holds far fewer than 2**31 elements.
    prefix = torch.zeros(1, dtype=torch.int32, device=dev)  # the high bits found so far
    remaining = torch.full((1,), k, dtype=torch.int32, device=dev)  # rank inside the bucket
    kernels = dispatch.choose("radix_select", flat) == "triton"
    for level, shift in enumerate(shifts):
        if kernels:  # one launch per pass (dropit_core.backends.triton.select): the same counters
            hist = dispatch.kernels("select").abs_bits_histogram(
                flat, shift, prefix if level else None
            )
        else:
            hist = _abs_bits_histogram(flat, bits_dtype, shift, level, prefix, slice_len)
        at_least = hist.flip(0).cumsum(0, dtype=torch.int32)  # [j]: in buckets >= 65535 - j
        j = torch.searchsorted(at_least, remaining)  # the first j with at_least[j] >= remaining
        chosen = 65535 - j
        remaining -= at_least.index_select(0, j) - hist.index_select(0, chosen)
        prefix = (prefix << 16) | chosen.to(torch.int32)
    # `remaining`, the k-th value's rank among the elements equal to it: the ties to keep.
    return _kth(prefix.to(bits_dtype).view(flat.dtype)[0], remaining, k)
