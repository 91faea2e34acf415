"""``importance`` (Wangni et al. 2018): keep x_i with probability p_i = min(1, |x_i| / tau), tau
set so that the expected kept fraction is 1 - gamma; a kept x_i rebuilds as x_i / p_i =
sign(x_i) max(|x_i|, tau): unbiased. The cache is min-k's plus tau, a device tensor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dropit_core.formats.keep_rule import IMPORTANCE, KeepRule
from dropit_core.formats.packed import Packed, tiny
from dropit_core.formats.seeds import hash_uniform, mix_seed
from dropit_core.strategies.base import SEED
from dropit_core.strategies.elementwise import (
    POSITIONS_OPTION,
    SAMPLE_OPTION,
    Elementwise,
    expected_capacity,
)
from dropit_core.strategies.select import sample_size, sample_stride


def water_level(magnitudes: torch.Tensor, budget: float) -> torch.Tensor:
    """The tau > 0 with ``sum(min(1, a / tau)) == budget`` over ``magnitudes`` a >= 0 (fp32,
    0-dim, on their device; 0 when all are zero), for 0 < budget <= len(magnitudes): sorted
    descending, the top j saturated, tau_j = sum(a[j:]) / (budget - j) at the smallest j with
    a[j] <= tau_j. One sort and one cumulative sum; no host sync."""
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
    options = (POSITIONS_OPTION, SAMPLE_OPTION, SEED)
    described = ("sample",)
    keeps = (
        "each element with probability `min(1, abs(x)/tau)`, tau set from a 64Ki sample so that "
        "`1 - gamma` of them are kept in expectation; rebuilt as `sign(x) max(abs(x), tau)`: "
        "unbiased (Wangni et al. 2018)"
    )
    cache_bytes = "n/8 + kept v + 4; GPU: n/8 + cap v + 12"
    draws = True
    # A kept value below tau rebuilds as +-tau by its sign, which an integer code of 0 lacks.
    signed_values = True

    def capacity(self, n: int) -> int:
        sample = sample_size(n, self.sample)
        return expected_capacity(n, 1.0 - self.gamma, sample=sample, draws=True)

    def _begin(self, flat: torch.Tensor, static: bool, key: int) -> _Draw:
        return _Draw(self._tau(flat), mix_seed(self.seed, key))

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
        threshold = hash_uniform(state.seed, start, piece.numel(), piece.device).mul_(state.tau)
        return piece.abs() > threshold

    def _kernel_rule(self, state: _Draw) -> KeepRule:
        return KeepRule(IMPORTANCE, state.tau, seed=state.seed)

    def _pack(self, x: torch.Tensor, layout: str, key: int) -> Packed:
        packed = super()._pack(x, layout, key)
        draw = packed.meta.state
        return packed._replace(meta=packed.meta._replace(state=None), threshold=draw.tau)

    def _rebuilt_values(self, values: torch.Tensor, packed: Packed) -> torch.Tensor:
        tau = packed.threshold.to(values.dtype)
        return torch.where(values.abs() < tau, torch.copysign(tau, values), values)
