"""The strategies that keep whole units: ``channel_mink`` and ``channel_random`` (planes of a
conv input, feature columns of a linear one), ``block_mink`` (b x b blocks) and ``pool`` (a
pooled copy, rebuilt as block means).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dropit_core.formats import packed as base
from dropit_core.formats.packed import BlocksMeta, Packed, PoolMeta, UnitsMeta
from dropit_core.formats.seeds import mix_seed
from dropit_core.formats.values import ValueCodec
from dropit_core.registry import Option
from dropit_core.strategies.base import SEED, Strategy, decoded, encoded, keep_count


def _fp32_norms(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """L2 norms over ``dims`` in fp32, a few million elements of ``t`` at a time (a bf16/fp16
    input is never copied to fp32 whole)."""
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
        rows = decoded(self.codec, packed, dtype, packed.index.numel() * width).view(-1, width)
        n_units = math.prod(shape[:-2]) if layout == "conv" else shape[-1]
        dense = torch.zeros(n_units, width, dtype=dtype, device=rows.device)
        dense.index_copy_(0, packed.index.long(), rows.to(dtype))
        return dense.view(shape) if layout == "conv" else dense.t().reshape(shape)


class ChannelMinK(_ChannelBase):
    """Drop the planes/feature columns with the smallest L2 norm."""

    name = "channel_mink"
    keeps = "the planes (conv) / feature columns (linear) with the largest L2 norm"
    cache_bytes = "kept planes v + 4 per plane"

    def _choose(self, units: torch.Tensor, k: int, key: int) -> torch.Tensor:
        return torch.topk(_fp32_norms(units, dims=(1,)), k, sorted=False).indices


class ChannelRandom(_ChannelBase):
    """Keep a uniformly random set of planes/feature columns."""

    name = "channel_random"
    options = (SEED,)
    keeps = "random planes / feature columns"
    cache_bytes = "as `channel_mink`"
    draws = True

    def _choose(self, units: torch.Tensor, k: int, key: int) -> torch.Tensor:
        # A generator on the planes' device, so the permutation is drawn where they are: a CPU
        # permutation copied to the GPU would be a blocking host-to-device copy per layer.
        dev = units.device
        gen = torch.Generator(device=dev).manual_seed(mix_seed(self.seed, key))
        return torch.randperm(units.shape[0], generator=gen, device=dev)[:k]


class BlockMinK(Strategy):
    """Keep the b x b blocks of each plane with the largest L2 norm (block-sparse rows, BSR)."""

    name = "block_mink"
    options = (Option("block", int, 4, "side of the square blocks", minimum=1),)
    keeps = "the `block x block` tiles of each plane with the largest L2 norm (BSR-style)"
    cache_bytes = "kept tiles v + 4 per tile"

    def _pack(self, x: torch.Tensor, layout: str, key: int) -> Packed:
        b = self.block
        planes = x.reshape(-1, *x.shape[-2:]) if layout == "conv" else x.reshape(1, -1, x.shape[-1])
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
        blocks = decoded(self.codec, packed, dtype, flat_idx.numel() * b * b).view(-1, b, b)
        grid = torch.zeros(m, hb, b, wb, b, dtype=dtype, device=blocks.device)
        mi, rest = flat_idx // (hb * wb), flat_idx % (hb * wb)
        grid[mi, rest // wb, :, rest % wb, :] = blocks
        return grid.view(m, hb * b, wb * b)[:, :h, :w].reshape(shape)


class Pool(Strategy):
    """Cache an f x f average pool of each plane; backward upsamples it (Barley & Froening). The
    default f keeps about 1-gamma of the input (gamma=0.75 -> 2, 0.9 -> 3): see ``factor``."""

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
    described = ("factor",)
    cache_bytes = "n/f² v"

    def __init__(
        self, gamma: float, codec: ValueCodec, rescale: str, *, factor: int | None
    ) -> None:
        super().__init__(gamma, codec, rescale)
        self.factor = max(1, round((1.0 - gamma) ** -0.5)) if factor is None else factor

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
        pooled = decoded(self.codec, packed, dtype, math.prod(pooled_shape)).view(pooled_shape)
        if layout == "conv":
            up = pooled.repeat_interleave(f, dim=-2).repeat_interleave(f, dim=-1)
            return up[..., : shape[-2], : shape[-1]].reshape(shape)
        up = pooled.repeat_interleave(f * f, dim=-1)
        return up[..., : shape[-1]].reshape(shape)
