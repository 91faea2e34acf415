"""Which elements of a layer input to keep for the weight gradient, and how to rebuild the rest.

Every strategy turns a layer input ``x`` into a few small tensors plus a named tuple of
plain-Python metadata (:meth:`Strategy.pack`; ``ElementsMeta``, ``UnitsMeta``, ``BlocksMeta``
or ``PoolMeta``) and rebuilds a dense tensor of ``x``'s shape from them in backward
(:meth:`Strategy.unpack`). Dropped elements come back as zeros (pooling: as block means).
Each strategy class declares its name and typed options; ``REGISTRY``, at the end, lists them
(see :mod:`dropit_core.registry`).

Layouts: ``"conv"`` inputs are ``(..., H, W)``; a *plane* is one ``H x W`` map of one sample
and channel. ``"linear"`` inputs are ``(..., F)``, seen as an ``R x F`` matrix; a *channel* is
one of the F feature columns.

Costs, for an input of n elements, kept fraction ``1 - gamma``, ``v`` bytes per stored value
(4 fp32, 2 fp16/bf16, 1 int8 + 4 bytes of scale per ``int8_chunk`` values, 1/2 int4 + 4 bytes
per ``int4_chunk``):

================  =====================================  ===========================================
strategy          cache bytes                            extra time in forward (backward: a scatter)
================  =====================================  ===========================================
mink              ceil(n/8) + kept*v                     the exact global k-th value of |x|
                                                         (the published method), bracketed by a
                                                         64Ki sample; the values above its low end
                                                         are gathered slice by slice: no dense copy
parallel_mink     ceil(n/8) + kept*v                     top-k inside chunks of D elements, in
                                                         slices of ~4M elements: no dense temporary
random            kept*v (mask rebuilt from a seed)      one random number per element
threshold         ceil(n/8) + kept*v                     gamma-quantile of ~64Ki |x| read at a
                                                         prime stride: O(n), no sort; kept count
                                                         approximate
channel_mink      kept_planes*(H*W)*v + 4*kept_planes    one L2 norm per plane, top-k over planes
channel_random    same as channel_mink                   a permutation of the planes
block_mink        kept_blocks*b*b*v + 4*kept_blocks      one L2 norm per b x b block, top-k blocks
pool              ceil(H/f)*ceil(W/f)*planes*v           one average pool (f from gamma or option)
================  =====================================  ===========================================

``kept`` is ``int((1 - gamma) * n)`` for mink and per chunk for parallel_mink; elements tied with
the threshold are kept too, and zeros are never stored (they rebuild as zeros anyway).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from . import select as select_mod
from .packing import (
    VALUE_FORMATS,
    ValueCodec,
    compact,
    compact_bits,
    pack_bits,
    scatter_kept,
    unpack_bits,
)
from .registry import Option, Registry
from .select import (
    abs_slices,
    bracket,
    kth_from_candidates,
    kth_largest_abs,
    largest,
    radix_kth_largest_abs,
    sample_stride,
)


class ElementsMeta(NamedTuple):
    """What an element-wise pack passes to its unpack besides the tensors."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    counts: tuple[int, ...]  # kept values per slice
    state: Any  # the |x| threshold (mink, threshold), the mask seed (random) or None


class UnitsMeta(NamedTuple):
    """What a plane/feature-column pack (channel_*) passes to its unpack."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str
    width: int  # elements per plane or feature column


class BlocksMeta(NamedTuple):
    """What a block_mink pack passes to its unpack: the plane grid before and after padding."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    planes: int
    height: int
    width: int
    block_rows: int
    block_cols: int


class PoolMeta(NamedTuple):
    """What a pool pack passes to its unpack."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str
    pooled_shape: tuple[int, ...]


PackMeta = ElementsMeta | UnitsMeta | BlocksMeta | PoolMeta
Packed = tuple[tuple[torch.Tensor, ...], PackMeta]

# Element-wise strategies work through the tensor in slices of this many elements, so that their
# bool/abs temporaries stay a few MB however large the layer input is.
_SLICE = 1 << 22

# How a rebuilt input is scaled before the weight gradient: as it is, or to the input's L2 norm.
RESCALES = ("none", "norm")
# Options every strategy takes: how the kept values are stored (see ValueCodec), and the scale.
COMMON_OPTIONS = (
    Option("values", str, "same", "how kept values are stored", choices=VALUE_FORMATS),
    Option("int8_chunk", int, ValueCodec.int8_chunk, "values per fp32 scale of `int8`", minimum=1),
    Option("int4_chunk", int, ValueCodec.int4_chunk, "values per fp32 scale of `int4`", minimum=1),
    Option(
        "rescale",
        str,
        "none",
        "`norm`: scale each rebuilt input by the L2 norm ratio of the input to the rebuilt one, "
        "so the weight gradient keeps the exact gradient's scale",
        choices=RESCALES,
    ),
)
POSITIONS = ("bits", "sparse_bits")
_POSITIONS = Option(
    "positions",
    str,
    POSITIONS[0],
    "the kept positions: a 1-bit mask, or only its non-zero bytes plus 1 bit per mask byte",
    choices=POSITIONS,
)
_SEED = Option("seed", int, 0, "seed of the random choice")


def _keep_count(gamma: float, n: int) -> int:
    return int((1.0 - gamma) * n)


def _tiny(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).tiny


def counts_first(device: torch.device) -> bool:
    """Whether packing must avoid data-dependent shapes: on an accelerator each would be a sync.

    There, element-wise packs count the kept elements of every slice first, read all counts in
    one host sync per layer, then gather with ``nonzero_static``. On the CPU a boolean index is
    as cheap as counting, so the pack is one pass.
    """
    return device.type != "cpu"


def _host_ints(values: list[torch.Tensor]) -> list[int]:
    """The one device-to-host read of an element-wise pack."""
    return torch.stack(values).tolist() if values else []


class Strategy:
    """Base class: pick what to keep of a layer input and rebuild a dense tensor from it.

    A subclass declares its ``name``, its ``options`` (passed to ``__init__`` as keywords, with
    the registry's defaults filled in) and, for the docs, what it ``keeps`` and its
    ``cache_bytes``; it is listed in ``REGISTRY`` at the end of this module.
    """

    name = ""
    options: tuple[Option, ...] = ()
    keeps = ""
    cache_bytes = ""
    # "norm": the cache also keeps ||x|| and scales the rebuilt input to it (see InputCache);
    # set by build_strategy from the common option of the same name.
    rescale = RESCALES[0]

    def __init__(self, gamma: float, codec: ValueCodec) -> None:
        self.gamma = gamma
        self.codec = codec

    def pack(self, x: torch.Tensor, layout: str) -> Packed:
        """Compress ``x`` (a ``"conv"`` or ``"linear"`` input) into tensors plus metadata."""
        raise NotImplementedError

    def unpack(self, tensors: tuple[torch.Tensor, ...], meta: PackMeta) -> torch.Tensor:
        """Rebuild a dense tensor of the packed input's shape and dtype."""
        raise NotImplementedError

    def describe(self) -> str:
        """Short human-readable form, e.g. ``mink(gamma=0.8)``."""
        params = [f"gamma={self.gamma}", *self._describe_params()]
        if self.rescale != RESCALES[0]:
            params.append(f"rescale={self.rescale}")
        return f"{self.name}({', '.join(params)})"

    def _describe_params(self) -> tuple[str, ...]:
        """The strategy's own settings worth showing in :meth:`describe`."""
        return ()


def _sparse_bits(bits: torch.Tensor, nonzero: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(which bytes of the mask are non-zero, 1 bit each; those bytes): at gamma 0.9 a fifth to
    half of the mask bytes are zero, and storing a zero byte as one bit saves 7/8 of it."""
    flags = bits != 0
    return pack_bits(flags), compact(bits, flags, nonzero)


def _dense_bits(flags: torch.Tensor, nonzero: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`_sparse_bits` for a mask of n elements."""
    n_bytes = (n + 7) // 8
    # one slice of whole mask bytes: the same rebuild as the values' (scatter_kept)
    return scatter_kept(flags, nonzero, [nonzero.numel()], n_bytes, max(8, 8 * len(flags)))


class _Elementwise(Strategy):
    """Keep single elements: a packed 1-bit position mask plus the kept values.

    ``positions="sparse_bits"`` stores the mask's non-zero bytes plus one bit per mask byte.
    """

    stores_mask = True

    def __init__(self, gamma: float, codec: ValueCodec, *, positions: str = POSITIONS[0]) -> None:
        super().__init__(gamma, codec)
        self.positions = positions

    def _begin(self, flat: torch.Tensor, static: bool) -> tuple[Any, torch.Tensor | None]:
        """Per-tensor state computed once before the slices (e.g. a global threshold).

        Returns (state, ok): ``ok`` is None or a 0-dim bool tensor that the pack reads with its
        counts; False means the state is unusable and :meth:`_exact` must redo it. ``static``:
        no host syncs allowed here (see :func:`counts_first`).
        """
        return None, None

    def _exact(self, flat: torch.Tensor) -> Any:
        """A state that is always right, for when :meth:`_begin` reported a miss."""
        raise NotImplementedError

    def _slice_mask(self, piece: torch.Tensor, start: int, state: Any) -> torch.Tensor:
        raise NotImplementedError

    def _slice_len(self) -> int:
        return _SLICE

    def pack(self, x: torch.Tensor, layout: str) -> Packed:
        flat = x.reshape(-1)
        nonzero_bytes = None
        if counts_first(flat.device):
            bits, values, counts, state, nonzero_bytes = self._pack_counts_first(flat)
        else:
            bits, values, counts, state = self._pack_one_pass(flat)
        if not values:  # an empty input
            values, bits = [flat], [pack_bits(flat.new_zeros(0, dtype=torch.bool))]
        vals = values[0] if len(values) == 1 else torch.cat(values)
        parts = self.codec.encode(vals)
        if self.stores_mask:
            packed_bits = bits[0] if len(bits) == 1 else torch.cat(bits)
            if self.positions == "sparse_bits":
                parts = (*_sparse_bits(packed_bits, nonzero_bytes), *parts)
            else:
                parts = (packed_bits, *parts)
        return parts, ElementsMeta(tuple(x.shape), x.dtype, tuple(counts), state)

    def _pack_one_pass(self, flat: torch.Tensor):
        state, ok = self._begin(flat, static=False)
        if ok is not None and not bool(ok):
            state = self._exact(flat)
        return self._pack_with_state(flat, state)

    def _pack_with_state(self, flat: torch.Tensor, state: Any):
        step = self._slice_len()
        bits, values, counts = [], [], []
        for start in range(0, flat.numel(), step):
            piece = flat[start : start + step]
            mask = self._slice_mask(piece, start, state)
            if self.stores_mask:  # compacting from the packed bits beats a boolean index
                bits.append(pack_bits(mask))
                kept = compact_bits(piece, bits[-1])
            else:
                kept = compact(piece, mask)
            values.append(kept)
            counts.append(kept.numel())
        return bits, values, counts, state

    def _masks_and_counts(self, flat: torch.Tensor, state: Any):
        """Per slice: the mask bits, the kept count and, for sparse bits, the non-zero bytes."""
        step = self._slice_len()
        bits, counts, nonzero = [], [], []
        for start in range(0, flat.numel(), step):
            mask = self._slice_mask(flat[start : start + step], start, state)
            counts.append(torch.count_nonzero(mask))
            if self.stores_mask:
                bits.append(pack_bits(mask))
                if self.positions == "sparse_bits":
                    nonzero.append(torch.count_nonzero(bits[-1]))
        return bits, counts, nonzero

    def _pack_counts_first(self, flat: torch.Tensor):
        state, ok = self._begin(flat, static=True)
        bits, counts, nonzero = self._masks_and_counts(flat, state)
        flags = [] if ok is None else [ok.to(torch.int64)]
        host = _host_ints(counts + nonzero + flags)
        if flags and not host[-1]:  # rare: the state was a miss; redo it exactly (more syncs)
            state = self._exact(flat)
            bits, counts, nonzero = self._masks_and_counts(flat, state)
            host = _host_ints(counts + nonzero)
        nonzero_bytes = sum(host[len(counts) : len(counts) + len(nonzero)])
        counts = host[: len(counts)]
        step = self._slice_len()
        values = []
        for i, start in enumerate(range(0, flat.numel(), step)):
            piece = flat[start : start + step]
            if self.stores_mask:  # unpacking the bits reads n/8 bytes, not the input again
                mask = unpack_bits(bits[i], piece.numel())
            else:
                mask = self._slice_mask(piece, start, state)
            values.append(compact(piece, mask, counts[i]))
        return bits, values, counts, state, nonzero_bytes

    def _rebuild_mask(self, tensors: tuple[torch.Tensor, ...], start: int, length: int, state: Any):
        bits = tensors[0][start // 8 : (start + length + 7) // 8]
        return unpack_bits(bits, length)

    def unpack(self, tensors: tuple[torch.Tensor, ...], meta: ElementsMeta) -> torch.Tensor:
        shape, dtype, counts, state = meta
        if self.stores_mask and self.positions == "sparse_bits":
            tensors = (_dense_bits(tensors[0], tensors[1], math.prod(shape)), *tensors[2:])
        value_parts = tensors[1:] if self.stores_mask else tensors
        values = self.codec.decode(tuple(value_parts), dtype, sum(counts))
        n = math.prod(shape)
        step = self._slice_len()
        if self.stores_mask:
            return scatter_kept(tensors[0], values, counts, n, step).view(shape)
        dense = torch.zeros(n, dtype=dtype, device=values.device)
        offset = 0
        # One slice's mask at a time: the only full-size tensor alive here is `dense` itself.
        for i, start in enumerate(range(0, n, step)):
            length = min(step, n - start)
            mask = self._rebuild_mask(tensors, start, length, state)
            dense[start : start + length].masked_scatter_(mask, values[offset : offset + counts[i]])
            offset += counts[i]
        return dense.view(shape)


class MinK(_Elementwise):
    """Keep the int((1-gamma)*n) largest |x| of the whole tensor (the published DropIT)."""

    name = "mink"
    options = (_POSITIONS,)
    keeps = (
        "the `int((1-gamma) n)` largest magnitudes of the whole tensor (the paper), exactly; "
        "found without a dense copy (a 64Ki sample brackets the k-th value, only the few "
        "elements inside the bracket are sorted)"
    )
    cache_bytes = "n/8 + kept v"

    def _begin(self, flat: torch.Tensor, static: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = flat.numel()
        k = _keep_count(self.gamma, n)
        if k == 0:
            return torch.full((), math.inf, dtype=flat.dtype, device=flat.device), None
        if k == n:
            return torch.full((), _tiny(flat.dtype), dtype=flat.dtype, device=flat.device), None
        # The k-th largest |x|, floored at the smallest normal number so that exact zeros are
        # dropped (they rebuild as zeros anyway); found without a dense |x| copy.
        return kth_largest_abs(flat, k, _SLICE, static)

    def _exact(self, flat: torch.Tensor) -> torch.Tensor:
        return radix_kth_largest_abs(flat, _keep_count(self.gamma, flat.numel()), _SLICE)

    def _pack_one_pass(self, flat: torch.Tensor):
        """Select and pack in two passes (CPU): the first gathers every value above the bracket's
        low end, a superset of the kept ones whose magnitudes also give the k-th value; the
        second only writes the mask bits, and the kept values are filtered from the superset."""
        n = flat.numel()
        k = _keep_count(self.gamma, n)
        if k in (0, n) or n <= select_mod._DIRECT:
            return super()._pack_one_pass(flat)
        b = bracket(flat, k)
        supersets = []
        for start, a in zip(range(0, n, _SLICE), abs_slices(flat, _SLICE), strict=True):
            supersets.append(compact_bits(flat[start : start + _SLICE], pack_bits(a >= b.lo)))
        above, candidates = 0, []
        for v in supersets:  # slice by slice: no superset-sized temporary
            m = v.abs()
            inside = m[m <= b.hi]  # the rest of the superset (all >= lo) lies above hi
            above += m.numel() - inside.numel()
            candidates.append(inside)
        t = kth_from_candidates(torch.cat(candidates), above, k, b)
        del candidates
        if t is None:  # the sample misled: exact radix select, then the plain pass
            return self._pack_with_state(flat, self._exact(flat))
        bits, values, counts = [], [], []
        for i, a in enumerate(abs_slices(flat, _SLICE)):
            bits.append(pack_bits(a >= t))
            v, supersets[i] = supersets[i], None  # each superset goes as its kept values come
            kept = v[v.abs() >= t]
            values.append(kept)
            counts.append(kept.numel())
        return bits, values, counts, t

    def _slice_mask(self, piece: torch.Tensor, start: int, state: torch.Tensor) -> torch.Tensor:
        return piece.abs() >= state


class ParallelMinK(_Elementwise):
    """Min-K inside each chunk of D consecutive elements (the paper's "Parallel Min-K")."""

    name = "parallel_mink"
    options = (_POSITIONS, Option("chunk", int, 1 << 14, "elements per chunk", minimum=1))
    keeps = "the same inside each chunk of `chunk` elements (the paper's parallel min-k)"
    cache_bytes = "n/8 + kept v"

    def __init__(self, gamma: float, codec: ValueCodec, *, chunk: int, positions: str) -> None:
        super().__init__(gamma, codec, positions=positions)
        self.chunk = chunk

    def _slice_len(self) -> int:
        # A multiple of both the chunk (chunks never straddle slices) and 8 (whole mask bytes).
        return self.chunk * 8 * max(1, _SLICE // (self.chunk * 8))

    def _rows_mask(self, a: torch.Tensor) -> torch.Tensor:
        rows, d = a.shape
        k = _keep_count(self.gamma, d)
        if k == 0:
            return torch.zeros_like(a, dtype=torch.bool)
        if k == d:
            return a >= _tiny(a.dtype)
        top = torch.topk(a, k, dim=1, sorted=False).values
        thr = top.amin(dim=1, keepdim=True).clamp_min(_tiny(a.dtype))
        return a >= thr

    def _slice_mask(self, piece: torch.Tensor, start: int, state: Any) -> torch.Tensor:
        a = piece.abs()
        full = (a.numel() // self.chunk) * self.chunk
        if full == a.numel():
            return self._rows_mask(a.view(-1, self.chunk)).view(-1)
        mask = torch.empty(a.numel(), dtype=torch.bool, device=a.device)
        if full:
            mask[:full] = self._rows_mask(a[:full].view(-1, self.chunk)).view(-1)
        mask[full:] = self._rows_mask(a[full:].view(1, -1)).view(-1)
        return mask

    def _describe_params(self) -> tuple[str, ...]:
        return (f"chunk={self.chunk}",)


class Threshold(_Elementwise):
    """Keep |x| above the gamma-quantile estimated from a fixed-size sample: O(n), no sort."""

    name = "threshold"
    options = (
        _POSITIONS,
        Option("sample", int, 1 << 16, "elements read to estimate the quantile", minimum=1),
    )
    keeps = "magnitudes above a gamma-quantile estimated from a 64Ki sample: no sort, O(n)"
    cache_bytes = "n/8 + kept v"

    def __init__(self, gamma: float, codec: ValueCodec, *, sample: int, positions: str) -> None:
        super().__init__(gamma, codec, positions=positions)
        self.sample = sample

    def _begin(self, flat: torch.Tensor, static: bool) -> tuple[torch.Tensor, None]:
        n = flat.numel()
        tiny = _tiny(flat.dtype)
        if self.gamma == 0.0 or n == 0:
            return torch.full((), tiny, dtype=flat.dtype, device=flat.device), None
        # A strided view costs nothing to take (prime stride: see sample_stride).
        sample = flat[:: sample_stride(n, self.sample)].abs()
        m = sample.numel()
        q = min(m, max(1, math.ceil(self.gamma * m)))  # the q-th smallest: the (m-q)-th largest
        return largest(sample, [m - q])[0].clamp_min(tiny), None

    def _slice_mask(self, piece: torch.Tensor, start: int, state: torch.Tensor) -> torch.Tensor:
        return piece.abs() >= state

    def _describe_params(self) -> tuple[str, ...]:
        return (f"sample={self.sample}",)


class RandomKeep(_Elementwise):
    """Keep each element with probability 1-gamma; the mask is rebuilt from a stored seed."""

    name = "random"
    options = (_SEED,)
    keeps = "each element with probability `1 - gamma` (the paper's contrast)"
    cache_bytes = "kept v (mask rebuilt from a seed)"
    stores_mask = False

    def __init__(self, gamma: float, codec: ValueCodec, *, seed: int) -> None:
        super().__init__(gamma, codec)
        self.seed = seed
        self._seeds = torch.Generator().manual_seed(seed)

    def _begin(self, flat: torch.Tensor, static: bool) -> tuple[int, None]:
        # A CPU generator: drawing the seed never waits for an accelerator.
        return int(torch.randint(0, 2**62, (1,), generator=self._seeds).item()), None

    def _slice_mask(self, piece: torch.Tensor, start: int, state: int) -> torch.Tensor:
        gen = torch.Generator(device=piece.device).manual_seed(state + start)
        return torch.rand(piece.numel(), generator=gen, device=piece.device) >= self.gamma

    def _rebuild_mask(self, tensors, start, length, state):
        gen = torch.Generator(device=tensors[0].device).manual_seed(state + start)
        return torch.rand(length, generator=gen, device=tensors[0].device) >= self.gamma


def _fp32_norms(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """L2 norms over ``dims`` in fp32, a few million elements of ``t`` at a time: a bf16/fp16
    input is never copied to fp32 whole (``vector_norm(dtype=...)`` copies it too)."""
    if t.shape[0] == 0:
        return torch.linalg.vector_norm(t.float(), dim=dims)
    step = max(1, _SLICE // max(1, t[0].numel()))
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

    def _choose(self, units: torch.Tensor, k: int) -> torch.Tensor:
        raise NotImplementedError

    def pack(self, x: torch.Tensor, layout: str) -> Packed:
        units = _units(x, layout)
        k = _keep_count(self.gamma, units.shape[0])
        idx = self._choose(units, k)
        rows = units.index_select(0, idx).reshape(-1)
        parts = self.codec.encode(rows)
        meta = UnitsMeta(tuple(x.shape), x.dtype, layout, units.shape[1])
        return (idx.to(torch.int32), *parts), meta

    def unpack(self, tensors: tuple[torch.Tensor, ...], meta: UnitsMeta) -> torch.Tensor:
        shape, dtype, layout, width = meta
        count = tensors[0].numel() * width
        rows = self.codec.decode(tuple(tensors[1:]), dtype, count).view(-1, width)
        return _restore_units(tensors[0], rows, shape, layout, dtype)


class ChannelMinK(_ChannelBase):
    """Drop the planes/feature columns with the smallest L2 norm."""

    name = "channel_mink"
    keeps = "the planes (conv) / feature columns (linear) with the largest L2 norm"
    cache_bytes = "kept planes v + 4 per plane"

    def _choose(self, units: torch.Tensor, k: int) -> torch.Tensor:
        norms = _fp32_norms(units, dims=(1,))
        return torch.topk(norms, k, sorted=False).indices


class ChannelRandom(_ChannelBase):
    """Keep a uniformly random set of planes/feature columns."""

    name = "channel_random"
    options = (_SEED,)
    keeps = "random planes / feature columns"
    cache_bytes = "as `channel_mink`"

    def __init__(self, gamma: float, codec: ValueCodec, *, seed: int) -> None:
        super().__init__(gamma, codec)
        self.seed = seed
        self._gens: dict[torch.device, torch.Generator] = {}

    def _choose(self, units: torch.Tensor, k: int) -> torch.Tensor:
        # One generator per device, so the permutation is drawn where the planes are: a CPU
        # permutation copied to the GPU would be a blocking host-to-device copy per layer.
        dev = units.device
        if dev not in self._gens:
            self._gens[dev] = torch.Generator(device=dev).manual_seed(self.seed)
        return torch.randperm(units.shape[0], generator=self._gens[dev], device=dev)[:k]


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

    def __init__(self, gamma: float, codec: ValueCodec, *, block: int) -> None:
        super().__init__(gamma, codec)
        self.block = block

    def pack(self, x: torch.Tensor, layout: str) -> Packed:
        b = self.block
        planes = _as_planes(x, layout)
        m, h, w = planes.shape
        ph, pw = (-h) % b, (-w) % b
        if ph or pw:
            planes = F.pad(planes, (0, pw, 0, ph))
        hb, wb = (h + ph) // b, (w + pw) // b
        grid = planes.view(m, hb, b, wb, b)
        norms = _fp32_norms(grid, dims=(2, 4)).view(-1)
        k = _keep_count(self.gamma, norms.numel())
        flat_idx = torch.topk(norms, k, sorted=False).indices
        mi, rest = flat_idx // (hb * wb), flat_idx % (hb * wb)
        blocks = grid[mi, rest // wb, :, rest % wb, :].reshape(-1)
        parts = self.codec.encode(blocks)
        meta = BlocksMeta(tuple(x.shape), x.dtype, m, h, w, hb, wb)
        return (flat_idx.to(torch.int32), *parts), meta

    def unpack(self, tensors: tuple[torch.Tensor, ...], meta: BlocksMeta) -> torch.Tensor:
        shape, dtype, m, h, w, hb, wb = meta
        b = self.block
        flat_idx = tensors[0].long()
        blocks = self.codec.decode(tuple(tensors[1:]), dtype, flat_idx.numel() * b * b)
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

    def __init__(self, gamma: float, codec: ValueCodec, *, factor: int | None) -> None:
        super().__init__(gamma, codec)
        if factor is None:
            factor = max(1, round((1.0 - gamma) ** -0.5))
        self.factor = factor

    def pack(self, x: torch.Tensor, layout: str) -> Packed:
        f = self.factor
        if layout == "conv":
            planes = x.reshape(-1, 1, x.shape[-2], x.shape[-1])
            pooled = F.avg_pool2d(planes, f, f, ceil_mode=True)
        else:
            rows = x.reshape(-1, 1, x.shape[-1])
            pooled = F.avg_pool1d(rows, f * f, f * f, ceil_mode=True)
        parts = self.codec.encode(pooled.reshape(-1))
        return parts, PoolMeta(tuple(x.shape), x.dtype, layout, tuple(pooled.shape))

    def unpack(self, tensors: tuple[torch.Tensor, ...], meta: PoolMeta) -> torch.Tensor:
        shape, dtype, layout, pooled_shape = meta
        f = self.factor
        pooled = self.codec.decode(tuple(tensors), dtype, math.prod(pooled_shape))
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
    (MinK, ParallelMinK, RandomKeep, Threshold, ChannelMinK, ChannelRandom, BlockMinK, Pool),
    COMMON_OPTIONS,
)
STRATEGIES: tuple[str, ...] = REGISTRY.names
# Each strategy's own options and their types (a view of REGISTRY, kept for callers of 0.x).
STRATEGY_OPTIONS: dict[str, dict[str, type]] = {
    name: {o.name: o.type for o in REGISTRY.get(name).options} for name in STRATEGIES
}


def build_strategy(name: str, gamma: float, **options: Any) -> Strategy:
    """Validate a strategy name, gamma and options against ``REGISTRY``; return the strategy."""
    cls = REGISTRY.get(name)
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)):
        raise ValueError(f"DropIT gamma={gamma!r} is not a number: allowed 0 <= gamma < 1")
    gamma = float(gamma)
    if not 0.0 <= gamma < 1.0:
        raise ValueError(f"DropIT gamma={gamma} is out of range: allowed 0 <= gamma < 1")
    resolved = REGISTRY.resolve(name, options)
    codec = ValueCodec(
        resolved.pop("values"), resolved.pop("int8_chunk"), resolved.pop("int4_chunk")
    )
    rescale = resolved.pop("rescale")
    strategy = cls(gamma, codec, **resolved)
    strategy.rescale = rescale
    return strategy
