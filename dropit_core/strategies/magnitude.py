"""The element-wise strategies that keep the large magnitudes or a random part: ``mink`` (the
paper's), ``parallel_mink``, ``threshold`` and ``random``, on :mod:`.elementwise`'s pack.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dropit_core.formats import packed as base
from dropit_core.formats.bits import pack_bits
from dropit_core.formats.keep_rule import AT_LEAST, DRAW, TIES, KeepRule
from dropit_core.formats.packed import Packed, tiny
from dropit_core.formats.seeds import hash_uniform, mix_seed
from dropit_core.formats.values import ValueCodec
from dropit_core.registry import Option
from dropit_core.strategies import select as select_mod
from dropit_core.strategies.base import SEED, keep_count
from dropit_core.strategies.elementwise import (
    POSITIONS_OPTION,
    SAMPLE_OPTION,
    Elementwise,
    expected_capacity,
)
from dropit_core.strategies.select import (
    KthLargest,
    abs_slices,
    kth_largest_abs,
    largest,
    radix_kth_largest_abs,
    sample_size,
    sample_stride,
    select_superset,
)


class _TieBudget:
    """Min-k on a capacity of k: every |x| above the k-th value, then the elements equal to it
    in flat order until k are kept. Slices are masked in order; ``left`` carries the ties still
    to keep from one slice to the next, on the device."""

    def __init__(self, kth: KthLargest) -> None:
        self.value, self.left = kth

    def mask(self, piece: torch.Tensor) -> torch.Tensor:
        a = piece.abs()
        tie = a == self.value
        rank = torch.cumsum(tie, 0, dtype=torch.int32)  # 1-based among this slice's ties
        keep = (a > self.value) | (tie & (rank <= self.left))
        if rank.numel():
            self.left = self.left - rank[-1]
        return keep


class MinK(Elementwise):
    """Keep the int((1-gamma)*n) largest |x| of the whole tensor (the published DropIT)."""

    name = "mink"
    options = (POSITIONS_OPTION,)
    keeps = (
        "the `int((1-gamma) n)` largest magnitudes of the whole tensor (the paper), exactly, "
        "ties with the k-th kept (GPU: in flat order until k); found without a dense copy (CPU: "
        "a 64Ki sample brackets the k-th value, only the few elements inside are sorted; GPU: "
        "a radix select)"
    )
    cache_bytes = "n/8 + kept v; GPU: n/8 + k v"
    exact_capacity = True

    def capacity(self, n: int) -> int:
        return keep_count(self.gamma, n)

    def _begin(self, flat: torch.Tensor, static: bool, key: int) -> torch.Tensor | _TieBudget:
        n = flat.numel()
        k = keep_count(self.gamma, n)
        if k in (0, n):  # keep nothing, or every non-zero element
            value = math.inf if k == 0 else tiny(flat.dtype)
            return torch.full((), value, dtype=flat.dtype, device=flat.device)
        # The k-th largest |x|, floored at the smallest normal number so that exact zeros are
        # dropped (they rebuild as zeros anyway); found without a dense |x| copy or a host read.
        kth = kth_largest_abs(flat, k, base.SLICE)
        return _TieBudget(kth) if static else kth.value

    def _slice_mask(self, piece: torch.Tensor, start: int, state) -> torch.Tensor:
        if isinstance(state, _TieBudget):
            return state.mask(piece)
        return piece.abs() >= state

    def _kept_state(self, state):
        return state.value if isinstance(state, _TieBudget) else state

    def _kernel_rule(self, state) -> KeepRule:
        if isinstance(state, _TieBudget):
            return KeepRule(TIES, state.value, state.left)
        return KeepRule(AT_LEAST, state)

    def _pack_one_pass(self, flat: torch.Tensor, key: int):
        """Select and pack in two passes (CPU): a superset of the kept values, which gives the k-th
        value (:func:`~.select.select_superset`), then the mask and the kept values from it."""
        n = flat.numel()
        k = keep_count(self.gamma, n)
        if k in (0, n) or n <= select_mod.DIRECT:
            return super()._pack_one_pass(flat, key)
        t, supersets = select_superset(flat, k, base.SLICE)
        if t is None:  # the sample misled: exact radix select, then the plain pass
            return self._pack_with_state(flat, radix_kth_largest_abs(flat, k, base.SLICE).value)
        bits, values = [], []
        for i, a in enumerate(abs_slices(flat, base.SLICE)):
            bits.append(pack_bits(a >= t))
            v, supersets[i] = supersets[i], None  # each superset goes as its kept values come
            values.append(v[v.abs() >= t])
        return bits, values, t


class ParallelMinK(Elementwise):
    """Min-K inside each chunk of D consecutive elements (the paper's "Parallel Min-K")."""

    name = "parallel_mink"
    options = (POSITIONS_OPTION, Option("chunk", int, 1 << 14, "elements per chunk", minimum=1))
    described = ("chunk",)
    keeps = "the same inside each chunk of `chunk` elements (the paper's parallel min-k)"
    cache_bytes = "n/8 + kept v; GPU: n/8 + k v"
    exact_capacity = True

    def slice_len(self) -> int:
        # A multiple of both the chunk (chunks never straddle slices) and 8 (whole mask bytes).
        return self.chunk * 8 * max(1, base.SLICE // (self.chunk * 8))

    def capacity(self, n: int) -> int:
        whole, tail = divmod(n, self.chunk)  # whole chunks, then the last one's tail
        return whole * keep_count(self.gamma, self.chunk) + keep_count(self.gamma, tail)

    def _begin(self, flat: torch.Tensor, static: bool, key: int) -> bool:
        # On a capacity of k per chunk, ties with a chunk's k-th value are kept in flat order.
        return static

    def _kept_state(self, state: bool) -> None:
        return None

    def _rows_mask(self, a: torch.Tensor, ties_in_order: bool) -> torch.Tensor:
        rows, d = a.shape
        k = keep_count(self.gamma, d)
        if k == 0:
            return torch.zeros_like(a, dtype=torch.bool)
        if k == d:
            return a >= tiny(a.dtype)
        kth = torch.topk(a, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
        thr = kth.clamp_min(tiny(a.dtype))
        if not ties_in_order:
            return a >= thr
        above = a > thr
        tie = a == thr
        # As many ties as the k largest hold (all of them once the floor raised thr).
        room = torch.where(kth < thr, k, k - above.sum(dim=1, keepdim=True))
        return above | (tie & (torch.cumsum(tie, 1, dtype=torch.int32) <= room))

    def _slice_mask(self, piece: torch.Tensor, start: int, state: bool) -> torch.Tensor:
        a = piece.abs()
        full = (a.numel() // self.chunk) * self.chunk  # whole chunks, then the tensor's tail
        rows = [a[:full].view(-1, self.chunk), a[full:].view(1, -1)]
        masks = [self._rows_mask(r, state).view(-1) for r in rows if r.numel()]
        return masks[0] if len(masks) == 1 else torch.cat(masks)


class Threshold(Elementwise):
    """Keep |x| above the gamma-quantile estimated from a fixed-size sample: O(n), no sort."""

    name = "threshold"
    options = (POSITIONS_OPTION, SAMPLE_OPTION)
    described = ("sample",)
    keeps = "magnitudes above a gamma-quantile estimated from a 64Ki sample: no sort, O(n)"
    cache_bytes = "n/8 + kept v; GPU: n/8 + cap v + 8"

    def capacity(self, n: int) -> int:
        return expected_capacity(n, 1.0 - self.gamma, sample=sample_size(n, self.sample))

    def _begin(self, flat: torch.Tensor, static: bool, key: int) -> torch.Tensor:
        n = flat.numel()
        floor = tiny(flat.dtype)
        if self.gamma == 0.0 or n == 0:
            return torch.full((), floor, dtype=flat.dtype, device=flat.device)
        # A strided view costs nothing to take (prime stride: see sample_stride).
        sample = flat[:: sample_stride(n, self.sample)].abs()
        m = sample.numel()
        q = min(m, max(1, math.ceil(self.gamma * m)))  # the q-th smallest: the (m-q)-th largest
        return largest(sample, [m - q])[0].clamp_min(floor)

    def _kernel_rule(self, state: torch.Tensor) -> KeepRule:
        return KeepRule(AT_LEAST, state)


class RandomKeep(Elementwise):
    """Keep each element with probability 1-gamma; the mask is rebuilt from a stored seed."""

    name = "random"
    options = (
        SEED,
        Option(
            "scale",
            bool,
            False,
            "multiply kept values by `1/(1-gamma)`: an unbiased estimate of the input "
            "(randomized autodiff, Oktay et al. 2021)",
        ),
    )
    keeps = (
        "each element with probability `1 - gamma` (the paper's contrast); with `scale: true` "
        "rebuilt times `1/(1-gamma)`: unbiased"
    )
    cache_bytes = "kept v (mask rebuilt from a seed); GPU: cap v + 8"
    stores_mask = False
    draws = True

    def __init__(self, gamma: float, codec: ValueCodec, rescale: str, **options: Any) -> None:
        super().__init__(gamma, codec, rescale, **options)  # seed, scale
        self._factor = 1.0 / (1.0 - gamma)

    def capacity(self, n: int) -> int:
        return expected_capacity(n, 1.0 - self.gamma, draws=True)

    def _begin(self, flat: torch.Tensor, static: bool, key: int) -> int:
        # A host integer: the mask seed never waits for an accelerator, and rides in the meta.
        return mix_seed(self.seed, key)

    def _slice_mask(self, piece: torch.Tensor, start: int, state: int) -> torch.Tensor:
        return self._rebuild_mask(start, piece.numel(), state, piece.device)

    def _rebuild_mask(
        self, start: int, length: int, state: int, device: torch.device
    ) -> torch.Tensor:
        return hash_uniform(state, start, length, device) >= self.gamma

    def _kernel_rule(self, state: int) -> KeepRule:
        return KeepRule(DRAW, seed=state, gamma=self.gamma)

    def _rebuilt_values(self, values: torch.Tensor, packed: Packed) -> torch.Tensor:
        # Out of place: the decoded values may be the cached tensor itself, which layers share.
        return values * self._factor if self.scale else values

    def _describe_params(self) -> tuple[str, ...]:
        return ("scale=true",) if self.scale else ()
