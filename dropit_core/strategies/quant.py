"""``quant`` (ActNN, Chen et al. 2021): every value, in groups of ``group``, as a ``bits``-bit
code of its place between the group's minimum and maximum, stochastically rounded: unbiased.
The format and its eager reference are :mod:`dropit_core.formats.quant`; the C loops and the
Triton kernels write the same bytes, as :mod:`dropit_core.backends.dispatch` chooses.
"""

from __future__ import annotations

import math

import torch

from dropit_core.backends import dispatch, native
from dropit_core.formats import quant as quant_format
from dropit_core.formats.bits import pack_bits, unpack_bits
from dropit_core.formats.packed import Packed, QuantMeta, quant_packed, tiny
from dropit_core.formats.quant import inv_levels
from dropit_core.formats.seeds import hash_keys, mix_part, mix_state, seed_of
from dropit_core.formats.values import ValueCodec
from dropit_core.registry import Option
from dropit_core.strategies.base import SEED, Strategy


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
    every_element = True
    skips_common = ("values", "int8_chunk", "int4_chunk")  # it stores codes, not kept values
    described = ("bits", "group")
    reads_through_cast = True  # codes are the same bytes whatever dtype they were read from

    def __init__(self, gamma: float, codec: ValueCodec, rescale: str, **options: int) -> None:
        super().__init__(gamma, codec, rescale, **options)  # bits, group, seed
        self._inv_levels = inv_levels(self.bits)
        self._seed_state = mix_state(0, self.seed)  # mix_seed(seed, key) per pack, folded once
        self._hashed: dict[int, tuple[int, int]] = {}  # draw_keys of the keys remember_draws saw
        # what this setting allows besides eager, asked per pack and rebuild: answered once
        self._fast = dispatch.quant_backends(self.bits, self.group)
        self._signed_fast = dispatch.quant_backends(self.bits, self.group, signs=True)

    def draw_keys(self, key: int | torch.Tensor) -> tuple[int, int] | tuple[torch.Tensor, ...]:
        """The hash keys (k0, k1) of the pack drawn with ``key`` (seeded ``mix_seed(seed, key)``);
        of each key of an int64 tensor of keys, two tensors."""
        return hash_keys(seed_of(mix_part(self._seed_state, key)))

    def remember_draws(self, keys: torch.Tensor) -> None:
        """Derive the hash keys of the next packs' draw keys together (a CPU int64 tensor), for
        each pack to look its own up: one tensor pass, not Python per pack (host time)."""
        k0, k1 = self.draw_keys(keys)
        pairs = zip(k0.tolist(), k1.tolist(), strict=True)
        self._hashed = dict(zip(keys.tolist(), pairs, strict=True))

    def _keys_of(self, key: int) -> tuple[int, int]:
        return self._hashed.get(key) or self.draw_keys(key)

    def pack(
        self, x: torch.Tensor, layout: str, key: int = 0, dtype: torch.dtype | None = None
    ) -> Packed:
        # Strategy.pack's cases, the usual one first without its calls (host time)
        if self.rescale == "none":
            return self._pack_as(x, key, x.dtype if dtype is None else dtype)
        return super().pack(x, layout, key, dtype)

    def _pack(self, x: torch.Tensor, layout: str, key: int) -> Packed:
        return self._pack_as(x, key, x.dtype)

    def _pack_cast(self, x: torch.Tensor, layout: str, key: int, dtype: torch.dtype) -> Packed:
        # Every path rounds each value to dtype as it reads it: x.to(dtype)'s pack, no copy
        return self._pack_as(x, key, dtype)

    def _pack_as(
        self, x: torch.Tensor, key: int, dtype: torch.dtype, keys: torch.Tensor | None = None
    ) -> Packed:
        """The pack of ``x`` read as ``dtype`` values (a float dtype, ``x``'s own or narrower),
        drawn with ``key``, or with the hash keys held in ``keys`` (:meth:`pack_keyed`)."""
        cast = None if dtype == x.dtype else dtype
        draw = self._keys_of(key) if keys is None else keys
        way = dispatch.choose("quant_pack", x, self._fast)
        if way == "triton":
            # The kernel reads memory flat: no reshape (each op here is host time on a GPU).
            kernels = dispatch.kernels("quant")
            codes, mins, scales = kernels.pack_contiguous(
                x.contiguous(), self.bits, self.group, draw, cast
            )[:3]
        else:
            if keys is not None:  # read on the host: a sync only off the kernels (CUDA, no triton)
                draw = tuple(keys.tolist()[:2])
            codes, mins, scales = self._pack_on_host(x.reshape(-1), draw, cast, way)
        return quant_packed(tuple(x.shape), dtype, codes, scales, mins)

    def pack_keyed(self, x: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype) -> Packed:
        """The pack of ``x`` read as ``dtype`` with its draw's hash keys read from ``keys`` (int64
        ``(k0, k1, ...)`` on ``x``'s device), bit for bit :meth:`pack`'s: a CUDA graph replays
        it with the keys a new step wrote there."""
        return self._pack_as(x, 0, dtype, keys)

    def _pack_on_host(
        self, flat: torch.Tensor, keys: tuple[int, int], cast: torch.dtype | None, way: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, mins, scales) drawn with ``keys``, by the C loops (``way`` "native") or eager."""
        n, group, bits = flat.numel(), self.group, self.bits
        out = quant_format.buffers(n, bits, group, flat.device)
        if way == "native":
            native.quant_pack(flat, bits, group, keys, self._inv_levels, *out, cast)
        else:
            quant_format.pack_eager(flat, keys, bits, group, cast, out)
        return out

    def unpack_part(self, packed: Packed, start: int, stop: int) -> torch.Tensor | None:
        # A range of whole groups starting on a whole code byte is a pack of its own
        if packed.norm is not None or start % self.group or start * self.bits % 8:
            return None
        values, mins, scales = quant_format.fields(packed, start, stop, self.bits, self.group)
        meta = QuantMeta((stop - start,), packed.meta.dtype)
        return self._unpack(Packed(meta, values=values, scales=scales, mins=mins))

    def _unpack(self, packed: Packed) -> torch.Tensor:
        shape, dtype = packed.meta
        n = math.prod(shape)
        way = dispatch.choose("quant_rebuild", packed.values, self._fast)
        if way == "triton":
            return dispatch.kernels("quant").quant_rebuild(
                packed.values, packed.mins, packed.scales, n, self.bits, self.group, dtype,
                shape=shape, check=False,
            )  # fmt: skip
        step = quant_format.slice_len(self.group)  # whole groups and whole code bytes
        return _rebuild_on_host(packed, n, self.bits, self.group, step, way)


def _rebuild_on_host(
    packed: Packed, n: int, bits: int, group: int, step: int, way: str
) -> torch.Tensor:
    """The rebuilt input of a quant pack off the kernels: the C loops (``way`` "native"; a
    narrower dtype than fp32 a slice of ``step`` values at a time), else the eager reference."""
    shape, dtype = packed.meta
    loops = way == "native"
    if loops and dtype == torch.float32:
        values = native.quant_rebuild(packed.values, packed.mins, packed.scales, n, bits, group)
        return values.view(shape)
    dense = torch.empty(n, dtype=dtype, device=packed.values.device)
    for start in range(0, n, step):  # slices hold whole groups and whole code bytes
        stop = min(start + step, n)
        if loops:
            # A narrower dtype: the loops' fp32 values cast a slice at a time (a whole map in
            # fp32 beside its cast was a bf16 CPU backward's largest tensor)
            values, mins, scales = quant_format.fields(packed, start, stop, bits, group)
            dense[start:stop].copy_(
                native.quant_rebuild(values, mins, scales, stop - start, bits, group)
            )
        else:
            # Eager: a few passes, faster than a compiled loop here (its codes unpack slowly).
            quant_format.rebuild_eager(packed, start, stop - start, bits, group, dense)
    return dense.view(shape)


def pack_signed(
    quant: Quant, x: torch.Tensor, key: int
) -> tuple[Packed, torch.Tensor, torch.Tensor]:
    """(``quant``'s pack of ``x``; the flags of its zeros; of its negative values), as
    ``pack_bits`` packs them: what ``CompressSaved`` keeps (one launch on the kernel path)."""
    if dispatch.choose("quant_signed", x, quant._signed_fast) == "triton":
        codes, mins, scales, zero, negative = dispatch.kernels("quant").pack_contiguous(
            x.contiguous(), quant.bits, quant.group, quant._keys_of(key), signs=True
        )
        return quant_packed(tuple(x.shape), x.dtype, codes, scales, mins), zero, negative
    flat = x.reshape(-1)
    return quant._pack_as(x, key, x.dtype), pack_bits(flat == 0), pack_bits(flat < 0)


def unpack_signed(
    quant: Quant, packed: Packed, zero: torch.Tensor, negative: torch.Tensor
) -> torch.Tensor:
    """The rebuilt tensor of :func:`pack_signed`, with the original's zeros (+0.0) and signs
    (every other value at least the dtype's smallest normal in magnitude)."""
    shape, dtype = packed.meta
    n = math.prod(shape)
    if dispatch.choose("quant_signed", packed.values, quant._signed_fast) == "triton":
        return dispatch.kernels("quant").quant_rebuild(
            packed.values, packed.mins, packed.scales, n, quant.bits, quant.group, dtype,
            signs=(zero, negative), shape=shape, check=False,
        )  # fmt: skip
    values = quant._unpack(packed).reshape(-1)
    magnitude = values.abs().clamp_min_(tiny(values.dtype))
    signed = torch.where(unpack_bits(negative, n), -magnitude, magnitude)
    return signed.masked_fill_(unpack_bits(zero, n), 0.0).view(shape)
