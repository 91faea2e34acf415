"""Which elements of a layer input to keep for the weight gradient, and how to rebuild the rest.

Every strategy turns a layer input ``x`` into a :class:`~dropit_core.base.Packed`: a few small
tensors in named fields plus a named tuple of plain-Python metadata (:meth:`Strategy.pack`) and
rebuilds a dense tensor of ``x``'s shape from it in backward (:meth:`Strategy.unpack`). Dropped
elements come back as zeros (pooling: as block means). Each strategy class declares its name
and typed options; ``REGISTRY``, at the end, lists them (see :mod:`dropit_core.registry`). The
base class and the options every strategy takes live in :mod:`dropit_core.base`, the
slice-by-slice element-wise pack in :mod:`dropit_core.elementwise`.

Layouts: ``"conv"`` inputs are ``(..., H, W)``; a *plane* is one ``H x W`` map of one sample
and channel. ``"linear"`` inputs are ``(..., F)``, seen as an ``R x F`` matrix; a *channel* is
one of the F feature columns.

Costs, for an input of n elements, kept fraction ``1 - gamma``, ``v`` bytes per stored value
(4 fp32, 2 fp16/bf16, 1 int8 + 4 bytes of scale per ``int8_chunk`` values, 1/2 int4 + 4 bytes
per ``int4_chunk``); "unbiased": the rebuilt input equals the input in expectation over the
pack's random draws (:mod:`dropit_core.unbiased`), so does the weight gradient:

================  =====================================  ===========================================
strategy          cache bytes                            extra time in forward (backward: a scatter)
================  =====================================  ===========================================
mink              ceil(n/8) + kept*v                     the exact global k-th value of |x|
                                                         (the published method): on the CPU
                                                         bracketed by a 64Ki sample, the values
                                                         above its low end gathered slice by
                                                         slice; on a GPU a radix select (two
                                                         histogram passes); no dense copy
parallel_mink     ceil(n/8) + kept*v                     top-k inside chunks of D elements, in
                                                         slices of ~4M elements: no dense temporary
random            kept*v (mask rebuilt from a seed)      one random number per element (see below);
                                                         ``scale``: kept values times 1/(1-gamma),
                                                         unbiased (backward: one pass over them)
threshold         ceil(n/8) + kept*v                     gamma-quantile of ~64Ki |x| read at a
                                                         prime stride: O(n), no sort; kept count
                                                         approximate
importance        ceil(n/8) + kept*v + 4 (tau, fp32)     tau from a sort of ~64Ki |x| (water
                                                         filling), one random number per element;
                                                         unbiased (backward: max(|v|, tau) on the
                                                         kept values); kept count random
channel_mink      kept_planes*(H*W)*v + 4*kept_planes    one L2 norm per plane, top-k over planes
channel_random    same as channel_mink                   a permutation of the planes
block_mink        kept_blocks*b*b*v + 4*kept_blocks      one L2 norm per b x b block, top-k blocks
pool              ceil(H/f)*ceil(W/f)*planes*v           one average pool (f from gamma or option)
quant             ceil(n*bits/8) + 8*ceil(n/group)       min/max per group, one random number per
                                                         element; unbiased; gamma unused (backward:
                                                         a dense multiply-add)
================  =====================================  ===========================================

``kept`` is ``int((1 - gamma) * n)`` for mink and per chunk for parallel_mink; on the CPU
elements tied with the threshold are kept too, and zeros are never stored (they rebuild as zeros
anyway).

On a GPU the element-wise strategies size their values from the shape, so that no host waits for
the device (:mod:`dropit_core.elementwise`): ``kept`` above is then the capacity, k for mink and
parallel_mink (ties with the k-th value are taken in flat order until k), and for threshold,
importance and random the expected count plus 8 standard deviations plus 64 (at 4Mi elements and
gamma 0.8: 1.064x the expected count for threshold and importance, 1.008x for random), plus 8
bytes counting what did not fit (``Packed.dropped``, summed per model by
``dropit_core.dropped_values``); slots past the kept values hold zeros. ``sparse_bits`` keeps
min(n/8, capacity) mask bytes there.

Random draws are seeded per pack from the strategy's ``seed`` and a key (:mod:`dropit_core.seeds`)
that the layers' InputCache derives from the training step and the pack's place in the forward:
call ``dropit_core.set_step(model, step)`` before each forward and a resumed run draws the same.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
import torch.nn.functional as F

from . import base
from . import select as select_mod
from .base import (
    CODEC_OPTIONS,
    COMMON_OPTIONS,
    SEED,
    BlocksMeta,
    Packed,
    PoolMeta,
    Strategy,
    UnitsMeta,
    decoded,
    encoded,
    keep_count,
)
from .elementwise import POSITIONS_OPTION, SAMPLE_OPTION, Elementwise, expected_capacity
from .keep_rule import AT_LEAST, DRAW, TIES, KeepRule
from .packing import ValueCodec, pack_bits
from .registry import Option, Registry
from .seeds import hash_uniform, mix_seed
from .select import (
    KthLargest,
    abs_slices,
    kth_largest_abs,
    largest,
    radix_kth_largest_abs,
    sample_size,
    sample_stride,
    select_superset,
    tiny,
)
from .unbiased import Importance, Quant


class _TieBudget:
    """Min-k on a capacity of k: every |x| above the k-th value, then the elements equal to it
    in flat order until k are kept. Slices are masked in order; ``left`` carries the ties still
    to keep from one slice to the next, on the device."""

    def __init__(self, kth: KthLargest) -> None:
        self.value, self.left = kth

    def mask(self, piece: torch.Tensor) -> torch.Tensor:
        """Which elements of the next slice to keep."""
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
        if k == 0:
            return torch.full((), math.inf, dtype=flat.dtype, device=flat.device)
        if k == n:
            return torch.full((), tiny(flat.dtype), dtype=flat.dtype, device=flat.device)
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
        """Select and pack in two passes (CPU): the first gathers every value above the bracket's
        low end, a superset of the kept ones whose magnitudes also give the k-th value
        (:func:`~dropit_core.select.select_superset`); the second only writes the mask bits, and
        the kept values are filtered from the superset."""
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
    keeps = "the same inside each chunk of `chunk` elements (the paper's parallel min-k)"
    cache_bytes = "n/8 + kept v; GPU: n/8 + k v"
    exact_capacity = True

    def __init__(
        self, gamma: float, codec: ValueCodec, rescale: str, *, chunk: int, positions: str
    ) -> None:
        super().__init__(gamma, codec, rescale, positions=positions)
        self.chunk = chunk

    def slice_len(self) -> int:
        # A multiple of both the chunk (chunks never straddle slices) and 8 (whole mask bytes).
        return self.chunk * 8 * max(1, base.SLICE // (self.chunk * 8))

    def capacity(self, n: int) -> int:
        # Whole chunks, then the last one's tail (slices hold whole chunks).
        return n // self.chunk * keep_count(self.gamma, self.chunk) + keep_count(
            self.gamma, n % self.chunk
        )

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
        top = torch.topk(a, k, dim=1, sorted=False).values
        kth = top.amin(dim=1, keepdim=True)
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
        full = (a.numel() // self.chunk) * self.chunk
        if full == a.numel():
            return self._rows_mask(a.view(-1, self.chunk), state).view(-1)
        mask = torch.empty(a.numel(), dtype=torch.bool, device=a.device)
        if full:
            mask[:full] = self._rows_mask(a[:full].view(-1, self.chunk), state).view(-1)
        mask[full:] = self._rows_mask(a[full:].view(1, -1), state).view(-1)
        return mask

    def _describe_params(self) -> tuple[str, ...]:
        return (f"chunk={self.chunk}",)


class Threshold(Elementwise):
    """Keep |x| above the gamma-quantile estimated from a fixed-size sample: O(n), no sort."""

    name = "threshold"
    options = (
        POSITIONS_OPTION,
        SAMPLE_OPTION,
    )
    keeps = "magnitudes above a gamma-quantile estimated from a 64Ki sample: no sort, O(n)"
    cache_bytes = "n/8 + kept v; GPU: n/8 + cap v + 8"

    def __init__(
        self, gamma: float, codec: ValueCodec, rescale: str, *, sample: int, positions: str
    ) -> None:
        super().__init__(gamma, codec, rescale, positions=positions)
        self.sample = sample

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

    def _describe_params(self) -> tuple[str, ...]:
        return (f"sample={self.sample}",)


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

    def __init__(
        self, gamma: float, codec: ValueCodec, rescale: str, *, seed: int, scale: bool
    ) -> None:
        super().__init__(gamma, codec, rescale)
        self.seed = seed
        self.scale = scale
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


def _fp32_norms(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """L2 norms over ``dims`` in fp32, a few million elements of ``t`` at a time: a bf16/fp16
    input is never copied to fp32 whole (``vector_norm(dtype=...)`` copies it too)."""
    if t.shape[0] == 0:
        return torch.linalg.vector_norm(t.float(), dim=dims)
    step = max(1, base.SLICE // max(1, t[0].numel()))
    parts = [
        torch.linalg.vector_norm(t[i : i + step].float(), dim=dims)
        for i in range(0, t.shape[0], step)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _units(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Rows to select among: planes (conv) or feature columns, transposed to rows (linear)."""
    if layout == "conv":
        return x.reshape(-1, x.shape[-2] * x.shape[-1])
    return x.reshape(-1, x.shape[-1]).t()


def _restore_units(
    idx: torch.Tensor, rows: torch.Tensor, shape: tuple[int, ...], layout: str, dtype
) -> torch.Tensor:
    n_units = math.prod(shape[:-2]) if layout == "conv" else shape[-1]
    dense = torch.zeros(n_units, rows.shape[1], dtype=dtype, device=rows.device)
    dense.index_copy_(0, idx.long(), rows.to(dtype))
    if layout == "conv":
        return dense.view(shape)
    return dense.t().reshape(shape)


class _ChannelBase(Strategy):
    """Keep whole planes (conv) or feature columns (linear)."""

    def _choose(self, units: torch.Tensor, k: int, key: int) -> torch.Tensor:
        raise NotImplementedError

    def _pack(self, x: torch.Tensor, layout: str, key: int) -> Packed:
        units = _units(x, layout)
        k = keep_count(self.gamma, units.shape[0])
        idx = self._choose(units, k, key)
        rows = units.index_select(0, idx).reshape(-1)
        meta = UnitsMeta(tuple(x.shape), x.dtype, layout, units.shape[1])
        return Packed(meta, index=idx.to(torch.int32), **encoded(self.codec, rows))

    def _unpack(self, packed: Packed) -> torch.Tensor:
        shape, dtype, layout, width = packed.meta
        count = packed.index.numel() * width
        rows = decoded(self.codec, packed, dtype, count).view(-1, width)
        return _restore_units(packed.index, rows, shape, layout, dtype)


class ChannelMinK(_ChannelBase):
    """Drop the planes/feature columns with the smallest L2 norm."""

    name = "channel_mink"
    keeps = "the planes (conv) / feature columns (linear) with the largest L2 norm"
    cache_bytes = "kept planes v + 4 per plane"

    def _choose(self, units: torch.Tensor, k: int, key: int) -> torch.Tensor:
        norms = _fp32_norms(units, dims=(1,))
        return torch.topk(norms, k, sorted=False).indices


class ChannelRandom(_ChannelBase):
    """Keep a uniformly random set of planes/feature columns."""

    name = "channel_random"
    options = (SEED,)
    keeps = "random planes / feature columns"
    cache_bytes = "as `channel_mink`"
    draws = True

    def __init__(self, gamma: float, codec: ValueCodec, rescale: str, *, seed: int) -> None:
        super().__init__(gamma, codec, rescale)
        self.seed = seed

    def _choose(self, units: torch.Tensor, k: int, key: int) -> torch.Tensor:
        # A generator on the planes' device, so the permutation is drawn where they are: a CPU
        # permutation copied to the GPU would be a blocking host-to-device copy per layer.
        dev = units.device
        gen = torch.Generator(device=dev).manual_seed(mix_seed(self.seed, key))
        return torch.randperm(units.shape[0], generator=gen, device=dev)[:k]


def _as_planes(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "conv":
        return x.reshape(-1, x.shape[-2], x.shape[-1])
    return x.reshape(1, -1, x.shape[-1])


class BlockMinK(Strategy):
    """Keep the b x b blocks of each plane with the largest L2 norm (block-sparse rows, BSR)."""

    name = "block_mink"
    options = (Option("block", int, 4, "side of the square blocks", minimum=1),)
    keeps = "the `block x block` tiles of each plane with the largest L2 norm (BSR-style)"
    cache_bytes = "kept tiles v + 4 per tile"

    def __init__(self, gamma: float, codec: ValueCodec, rescale: str, *, block: int) -> None:
        super().__init__(gamma, codec, rescale)
        self.block = block

    def _pack(self, x: torch.Tensor, layout: str, key: int) -> Packed:
        b = self.block
        planes = _as_planes(x, layout)
        m, h, w = planes.shape
        ph, pw = (-h) % b, (-w) % b
        if ph or pw:
            planes = F.pad(planes, (0, pw, 0, ph))
        hb, wb = (h + ph) // b, (w + pw) // b
        grid = planes.view(m, hb, b, wb, b)
        norms = _fp32_norms(grid, dims=(2, 4)).view(-1)
        k = keep_count(self.gamma, norms.numel())
        flat_idx = torch.topk(norms, k, sorted=False).indices
        mi, rest = flat_idx // (hb * wb), flat_idx % (hb * wb)
        blocks = grid[mi, rest // wb, :, rest % wb, :].reshape(-1)
        meta = BlocksMeta(tuple(x.shape), x.dtype, m, h, w, hb, wb)
        return Packed(meta, index=flat_idx.to(torch.int32), **encoded(self.codec, blocks))

    def _unpack(self, packed: Packed) -> torch.Tensor:
        shape, dtype, m, h, w, hb, wb = packed.meta
        b = self.block
        flat_idx = packed.index.long()
        blocks = decoded(self.codec, packed, dtype, flat_idx.numel() * b * b)
        blocks = blocks.view(-1, b, b)
        grid = torch.zeros(m, hb, b, wb, b, dtype=dtype, device=blocks.device)
        mi, rest = flat_idx // (hb * wb), flat_idx % (hb * wb)
        grid[mi, rest // wb, :, rest % wb, :] = blocks
        planes = grid.view(m, hb * b, wb * b)[:, :h, :w]
        return planes.reshape(shape)


class Pool(Strategy):
    """Cache an f x f average pool of each plane; backward upsamples it (Barley & Froening).

    The factor defaults to round(1/sqrt(1-gamma)) so that about 1-gamma of the input is kept
    (gamma=0.75 -> 2, 0.9 -> 3); linear inputs are pooled by f*f along the features.
    """

    name = "pool"
    options = (
        Option(
            "factor",
            int,
            None,
            "pooling window side (linear inputs: `factor`² features)",
            minimum=1,
            default_doc="`round(1/sqrt(1-gamma))`",
        ),
    )
    keeps = "an average-pooled copy, upsampled in backward (Barley & Fröning)"
    cache_bytes = "n/f² v"

    def __init__(
        self, gamma: float, codec: ValueCodec, rescale: str, *, factor: int | None
    ) -> None:
        super().__init__(gamma, codec, rescale)
        if factor is None:
            factor = max(1, round((1.0 - gamma) ** -0.5))
        self.factor = factor

    def _pack(self, x: torch.Tensor, layout: str, key: int) -> Packed:
        f = self.factor
        if layout == "conv":
            planes = x.reshape(-1, 1, x.shape[-2], x.shape[-1])
            pooled = F.avg_pool2d(planes, f, f, ceil_mode=True)
        else:
            rows = x.reshape(-1, 1, x.shape[-1])
            pooled = F.avg_pool1d(rows, f * f, f * f, ceil_mode=True)
        meta = PoolMeta(tuple(x.shape), x.dtype, layout, tuple(pooled.shape))
        return Packed(meta, **encoded(self.codec, pooled.reshape(-1)))

    def _unpack(self, packed: Packed) -> torch.Tensor:
        shape, dtype, layout, pooled_shape = packed.meta
        f = self.factor
        pooled = decoded(self.codec, packed, dtype, math.prod(pooled_shape))
        pooled = pooled.view(pooled_shape)
        if layout == "conv":
            up = pooled.repeat_interleave(f, dim=-2).repeat_interleave(f, dim=-1)
            return up[..., : shape[-2], : shape[-1]].reshape(shape)
        up = pooled.repeat_interleave(f * f, dim=-1)
        return up[..., : shape[-1]].reshape(shape)

    def _describe_params(self) -> tuple[str, ...]:
        return (f"factor={self.factor}",)


# The one list of strategies, in the order users see them (config choices, messages, docs).
REGISTRY = Registry(
    (
        MinK,
        ParallelMinK,
        RandomKeep,
        Threshold,
        Importance,
        ChannelMinK,
        ChannelRandom,
        BlockMinK,
        Pool,
        Quant,
    ),
    COMMON_OPTIONS,
)
STRATEGIES: tuple[str, ...] = REGISTRY.names


def build_strategy(name: str | type, gamma: float, **options: Any) -> Strategy:
    """Validate a strategy (a registered name, or a strategy class), gamma and options against
    ``REGISTRY``; return the strategy."""
    cls = REGISTRY.get(name)
    name = cls.name
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real):  # numpy floats too
        raise ValueError(f"DropIT gamma={gamma!r} is not a number: allowed 0 <= gamma < 1")
    gamma = float(gamma)
    if not 0.0 <= gamma < 1.0:
        raise ValueError(f"DropIT gamma={gamma} is out of range: allowed 0 <= gamma < 1")
    resolved = REGISTRY.resolve(name, options)
    codec = ValueCodec(
        **{field: resolved.pop(key) for key, field in CODEC_OPTIONS.items() if key in resolved}
    )
    return cls(gamma, codec, resolved.pop("rescale"), **resolved)
