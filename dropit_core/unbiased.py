"""Unbiased caches: the rebuilt input equals the input in expectation over the pack's draws.

The weight gradient of a conv or linear layer is linear in its cached input, so an unbiased
rebuild gives an unbiased weight gradient; min-k is biased (it always drops the small values).

- ``importance`` (Wangni et al. 2018): keep x_i with probability p_i = min(1, |x_i| / tau), tau
  set so that the expected kept fraction is 1 - gamma; a kept x_i rebuilds as x_i / p_i =
  sign(x_i) max(|x_i|, tau). The cache is min-k's (position bits, kept values) plus tau.
- ``quant`` (ActNN, Chen et al. 2021): every value, in groups of ``group`` consecutive values,
  as a ``bits``-bit code of its place between the group's minimum and maximum, rounded up with
  probability equal to the remainder (stochastic rounding); rebuilt as minimum + code * step.

Both draw their random numbers from the pack's seed (:mod:`dropit_core.seeds`), slice by slice on
the input's device; neither needs a host sync (importance's tau stays a device tensor).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import base
from .base import SEED, Packed, QuantMeta, Strategy
from .elementwise import POSITIONS_OPTION, SAMPLE_OPTION, Elementwise
from .packing import ValueCodec, pack_codes, unpack_codes
from .registry import Option
from .seeds import mix_seed, uniform
from .select import sample_stride, tiny


def water_level(magnitudes: torch.Tensor, budget: float) -> torch.Tensor:
    """The tau > 0 with ``sum(min(1, a / tau)) == budget`` over ``magnitudes`` a >= 0 (fp32,
    0-dim, on their device; 0 when they are all zero), for 0 < budget <= len(magnitudes).

    With the magnitudes sorted descending and the top j saturated (p = 1), tau_j =
    sum(a[j:]) / (budget - j); the answer is the smallest j whose largest unsaturated value
    a[j] <= tau_j (that test only turns true as j grows, and it holds at the last j < budget).
    One sort and one cumulative sum of the sample; no host sync.
    """
    a = torch.sort(magnitudes.float(), descending=True).values
    tail = a.double().flip(0).cumsum(0).flip(0)  # tail[j] = sum(a[j:]), in fp64
    room = budget - torch.arange(a.numel(), dtype=torch.float64, device=a.device)
    fits = (room > 0) & (tail >= a * room)
    first = torch.argmax(fits.to(torch.uint8)).view(1)  # the first True
    # index_select, not tail[first]: a 0-dim index would be read on the host (a sync).
    return (tail.index_select(0, first) / room.index_select(0, first)).float().squeeze(0)


class _Draw(NamedTuple):
    """What an importance pack needs for every slice: tau and the pack's seed."""

    tau: torch.Tensor  # fp32, 0-dim, a value of the input's dtype, >= its smallest normal
    seed: int


class Importance(Elementwise):
    """Keep x_i with probability min(1, |x_i|/tau); rebuild it as sign(x_i) max(|x_i|, tau)."""

    name = "importance"
    options = (
        POSITIONS_OPTION,
        SAMPLE_OPTION,
        SEED,
    )
    keeps = (
        "each element with probability `min(1, abs(x)/tau)`, tau set from a 64Ki sample so that "
        "`1 - gamma` of them are kept in expectation; rebuilt as `sign(x) max(abs(x), tau)`: "
        "unbiased (Wangni et al. 2018)"
    )
    cache_bytes = "n/8 + kept v + 4"
    draws = True

    def __init__(
        self,
        gamma: float,
        codec: ValueCodec,
        rescale: str,
        *,
        positions: str,
        sample: int,
        seed: int,
    ) -> None:
        super().__init__(gamma, codec, rescale, positions=positions)
        self.sample = sample
        self.seed = seed

    def _begin(self, flat: torch.Tensor, static: bool, key: int) -> tuple[_Draw, None]:
        return _Draw(self._tau(flat), mix_seed(self.seed, key)), None

    def _tau(self, flat: torch.Tensor) -> torch.Tensor:
        n = flat.numel()
        floor = tiny(flat.dtype)
        if self.gamma == 0.0 or n == 0:  # every non-zero is kept: p = 1 for all |x| >= floor
            return torch.full((), floor, dtype=torch.float32, device=flat.device)
        # A strided view costs nothing to take (prime stride: see sample_stride).
        sample = flat[:: sample_stride(n, self.sample)].abs()
        tau = water_level(sample, (1.0 - self.gamma) * sample.numel())
        # A value of the input's dtype, so that keeping and rebuilding use the same tau.
        return tau.to(flat.dtype).float().clamp_min(floor)

    def _slice_mask(self, piece: torch.Tensor, start: int, state: _Draw) -> torch.Tensor:
        # |x| > u tau with u uniform in [0, 1): probability |x|/tau below tau, 1 at or above it,
        # and 0 for exact zeros.
        threshold = uniform(state.seed, start, piece.numel(), piece.device).mul_(state.tau)
        return piece.abs() > threshold

    def _pack(self, x: torch.Tensor, layout: str, key: int) -> Packed:
        packed = super()._pack(x, layout, key)
        draw = packed.meta.state
        return packed._replace(meta=packed.meta._replace(state=None), threshold=draw.tau)

    def _rebuilt_values(self, values: torch.Tensor, packed: Packed) -> torch.Tensor:
        tau = packed.threshold.to(values.dtype)
        return torch.where(values.abs() < tau, torch.copysign(tau, values), values)

    def _describe_params(self) -> tuple[str, ...]:
        return (f"sample={self.sample}",)


class Quant(Strategy):
    """Every value as a ``bits``-bit stochastically rounded code of its group's range (ActNN)."""

    name = "quant"
    options = (
        Option("bits", int, 4, "bits per value", choices=(2, 4, 8)),
        Option(
            "group", int, 256, "consecutive values sharing one fp32 minimum and step", minimum=1
        ),
        SEED,
    )
    keeps = (
        "every element as a `bits`-bit code between its group's minimum and maximum, "
        "stochastically rounded (ActNN): unbiased; gamma unused"
    )
    cache_bytes = "n bits/8 + 8 n/group"
    draws = True
    uses_gamma = False
    skips_common = ("values", "int8_chunk", "int4_chunk")  # it stores codes, not kept values

    def __init__(
        self, gamma: float, codec: ValueCodec, rescale: str, *, bits: int, group: int, seed: int
    ) -> None:
        super().__init__(gamma, codec, rescale)
        self.bits = bits
        self.group = group
        self.seed = seed
        self._levels = (1 << bits) - 1

    def slice_len(self) -> int:
        """Elements per slice: whole groups and whole code bytes."""
        return self.group * 8 * max(1, base.SLICE // (self.group * 8))

    def _groups(self, piece: torch.Tensor) -> torch.Tensor:
        """The slice as fp32 rows of ``group`` values; a last partial group repeats its last
        value (the group's range stays its own)."""
        pad = (-piece.numel()) % self.group
        if pad:
            piece = torch.cat([piece, piece[-1:].expand(pad)])
        return piece.float().view(-1, self.group)

    def _pack(self, x: torch.Tensor, layout: str, key: int) -> Packed:
        flat = x.reshape(-1)
        seed = mix_seed(self.seed, key)
        step = self.slice_len()
        codes, mins, scales = [], [], []
        for start in range(0, flat.numel(), step):
            piece = flat[start : start + step]
            g = self._groups(piece)
            lo = g.amin(dim=1)
            scale = ((g.amax(dim=1) - lo) / self._levels).clamp_min(tiny(torch.float32))
            y = (g - lo[:, None]).div_(scale[:, None])  # in [0, levels]: the exact code
            y += uniform(seed, start, y.numel(), y.device).view_as(y)
            # floor(y + u): y rounded up with probability equal to its remainder.
            code = y.floor_().clamp_(0, self._levels).view(-1)[: piece.numel()].to(torch.uint8)
            codes.append(pack_codes(code, self.bits))
            mins.append(lo)
            scales.append(scale)
        if not codes:  # an empty input
            empty = flat.new_zeros(0, dtype=torch.float32)
            codes, mins, scales = [flat.new_zeros(0, dtype=torch.uint8)], [empty], [empty]
        return Packed(
            QuantMeta(tuple(x.shape), x.dtype),
            values=_joined(codes),
            scales=_joined(scales),
            mins=_joined(mins),
        )

    def _unpack(self, packed: Packed) -> torch.Tensor:
        shape, dtype = packed.meta
        n = math.prod(shape)
        dense = torch.empty(n, dtype=dtype, device=packed.values.device)
        step = self.slice_len()
        for start in range(0, n, step):
            length = min(step, n - start)
            first_byte = start * self.bits // 8
            last_byte = ((start + length) * self.bits + 7) // 8
            code = unpack_codes(packed.values[first_byte:last_byte], self.bits, length)
            rows = math.ceil(length / self.group)
            g0 = start // self.group
            values = F.pad(code, (0, rows * self.group - length)).float().view(rows, -1)
            values.mul_(packed.scales[g0 : g0 + rows, None]).add_(packed.mins[g0 : g0 + rows, None])
            dense[start : start + length] = values.view(-1)[:length]
        return dense.view(shape)

    def _describe_params(self) -> tuple[str, ...]:
        return (f"bits={self.bits}", f"group={self.group}")


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
