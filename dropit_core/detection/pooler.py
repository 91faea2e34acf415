"""The lean forward's RoI pooler: torchvision's, pooling under autocast a few images at a time,
and the handed-over pyramid (:class:`ConsumableMaps`) it empties as its last reader.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torchvision
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torchvision.ops.poolers import (
    MultiScaleRoIAlign,
    # torchvision's own, so the maps, RoIs and scales are picked and made as its pooler does
    _convert_to_roi_format,
    _filter_input,
    _setup_scales,
)

from dropit_core.formats.bits import SAME_WIDTH_INT


class ConsumableMaps(OrderedDict):
    """Feature maps handed over: the reader may drop each map after its last use.
    ``last_reader``: the module whose call is the dict's last use (it empties the dict); None:
    the reader drops the maps it has used (the FPN's inputs)."""

    def __init__(self, maps: dict[str, Tensor], last_reader: nn.Module | None = None) -> None:
        super().__init__(maps)
        self.last_reader = last_reader


class LeanMultiScaleRoIAlign(MultiScaleRoIAlign):
    """torchvision's RoI pooler, which empties handed-over maps as their last reader. Under
    autocast (whose ``roi_align`` casts a whole level to fp32) each level is pooled a few images
    at a time (:class:`_PoolByImage`), bit for bit torchvision's."""

    def forward(
        self, x: dict[str, Tensor], boxes: list[Tensor], image_shapes: list[tuple[int, int]]
    ) -> Tensor:
        maps = _filter_input(x, self.featmap_names)
        if _pools_here(maps):
            if self.scales is None or self.map_levels is None:
                self.scales, self.map_levels = _setup_scales(
                    maps, image_shapes, self.canonical_scale, self.canonical_level
                )
            # Autocast's roi_align casts the maps to fp32 where any is narrower
            narrow = any(m.dtype != torch.float32 for m in maps)
            cast = narrow and torch.is_autocast_enabled(maps[0].device.type)
            out = self._pool_by_image(maps, boxes, cast=cast)
        else:
            out = super().forward(x, boxes, image_shapes)
        del maps
        if isinstance(x, ConsumableMaps) and x.last_reader is self:
            x.clear()
        return out

    def _pool_by_image(self, maps: list[Tensor], boxes: list[Tensor], cast: bool) -> Tensor:
        """torchvision's ``_multiscale_roi_align``; ``cast``: in fp32 by groups of images."""
        rois = _convert_to_roi_format(boxes)
        images, levels_n = len(boxes), len(maps)
        one = levels_n == 1
        levels = rois.new_zeros(len(rois), dtype=torch.int64) if one else self.map_levels(boxes)
        # RoIs sorted by (level, image), stable: each group's RoIs are one slice of ``order``, in
        # torchvision's order. One host sync for all levels (torchvision makes one per level).
        key = levels * images + rois[:, 0].to(torch.int64)
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=levels_n * images).tolist()
        finest = maps[0][0].numel()  # the largest fp32 copy allowed: one image's finest level
        plan, start = [], 0
        for level, fmap in enumerate(maps):
            group = max(1, finest // max(1, fmap[0].numel())) if cast else images
            parts = []
            for lo in range(0, images, group):
                hi = min(images, lo + group)
                n = sum(counts[level * images + lo : level * images + hi])
                if n:  # images no RoI reads here get zeros in the backward, as torchvision's
                    parts.append((lo, hi, start, start + n))
                    start += n
            plan.append(parts)
        meta = (tuple(self.scales), tuple(self.output_size), self.sampling_ratio, plan, cast)
        return _PoolByImage.apply(meta, rois, order, *maps)


class _PoolByImage(torch.autograd.Function):
    """torchvision's multi-level ``roi_align``, under autocast a group of images at a time (one
    group's fp32 copy alive), backward alike. ``meta``: (scales, output size, sampling ratio, per
    level its groups (lo, hi, start, end): images lo:hi, RoIs ``order[start:end]``; cast)."""

    @staticmethod
    def forward(ctx, meta, rois: Tensor, order: Tensor, *maps: Tensor) -> Tensor:
        scales, size, sampling_ratio, plan, cast = meta
        ctx.meta, ctx.maps = meta, [(m.shape, m.dtype) for m in maps]
        # The RoIs saved as their bits in an integer view: saved-tensor hooks still count them,
        # but compress_saved leaves integers alone, where it would keep coordinates as lossy
        # 4-bit codes (and move every bilinear weight of the backward)
        ctx.rois_dtype = rois.dtype
        ctx.save_for_backward(rois.view(SAME_WIDTH_INT[rois.element_size()]), order)
        result = maps[0].new_zeros((len(rois), maps[0].shape[1], *size))
        with torch.autocast(maps[0].device.type, enabled=False):
            for fmap, scale, parts in zip(maps, scales, plan, strict=True):
                for lo, hi, start, end in parts:
                    picked = order[start:end]
                    part, part_rois = _operands(fmap[lo:hi], rois[picked], lo, cast)
                    pooled = torch.ops.torchvision.roi_align(
                        part, part_rois, scale, *size, sampling_ratio, False
                    )
                    del part  # the fp32 copy goes before the next group's is made
                    result[picked] = pooled.to(fmap.dtype).to(result.dtype)
                    del pooled
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        scales, size, sampling_ratio, plan, cast = ctx.meta
        bits, order = ctx.saved_tensors
        rois = bits.view(ctx.rois_dtype)
        grads = []
        for (shape, dtype), scale, parts, needed in zip(
            ctx.maps, scales, plan, ctx.needs_input_grad[3:], strict=True
        ):
            if not needed:
                grads.append(None)
                continue
            grad_map, done = None, 0
            for lo, hi, start, end in parts:
                picked = order[start:end]
                part_grad, part_rois = _operands(grad[picked].to(dtype), rois[picked], lo, cast)
                part = torch.ops.torchvision._roi_align_backward(
                    part_grad, part_rois, scale, *size, hi - lo, *shape[1:], sampling_ratio, False
                )
                if (lo, hi) == (0, shape[0]) and part.dtype == dtype:
                    grad_map, done = part, hi  # the whole level in its dtype: the kernel's own
                    continue
                if grad_map is None:
                    grad_map = grad.new_empty(shape, dtype=dtype)
                grad_map[done:lo].zero_()
                grad_map[lo:hi].copy_(part)
                del part
                done = hi
            if grad_map is None:  # no RoI read this level
                grad_map = grad.new_empty(shape, dtype=dtype)
            grad_map[done:].zero_()
            grads.append(grad_map)
        return (None, None, None, *grads)


def _operands(x: Tensor, rois: Tensor, lo: int, cast: bool) -> tuple[Tensor, Tensor]:
    """``x`` and the RoIs of images ``lo``.. renumbered from 0 (the batch index is their first
    column), both in fp32 where autocast would cast them."""
    if lo:
        rois = rois - rois.new_tensor([lo, 0.0, 0.0, 0.0, 0.0])
    return (x.float(), rois.float()) if cast else (x, rois)


def _pools_here(maps: list[Tensor]) -> bool:
    """Whether :class:`_PoolByImage` pools these maps: not while compiling or tracing, nor where
    torchvision pools in Python (without its compiled ops, or deterministic on a GPU)."""
    if not maps or not torchvision.extension._has_ops():
        return False
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or torchvision._is_tracing():
        return False
    return maps[0].device.type == "cpu" or not torch.are_deterministic_algorithms_enabled()


def last_pooler(roi_heads: nn.Module) -> nn.Module | None:
    """The RoI pooler that reads the pyramid last in torchvision's ``RoIHeads.forward`` (box,
    then mask, then keypoint), or None when it is not a lean pooler or also pools earlier."""
    names = ("box_roi_pool", "mask_roi_pool", "keypoint_roi_pool")
    poolers = [p for p in (getattr(roi_heads, name, None) for name in names) if p is not None]
    last = poolers[-1] if poolers else None
    lean = isinstance(last, LeanMultiScaleRoIAlign) and sum(p is last for p in poolers) == 1
    return last if lean else None
