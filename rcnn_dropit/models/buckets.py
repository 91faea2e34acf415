"""Size buckets: every batch padded to the smallest of a few fixed (height, width) sizes that
holds it, so that the backbone sees few input shapes (one CUDA graph or compiled graph each)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torchvision
from torch import Tensor, nn
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops.poolers import initLevelMapper

Size = tuple[int, int]  # (height, width) in pixels


def padded_size(images: Sequence[Tensor], size_divisible: int) -> Size:
    """The size torchvision pads a batch to: its largest height and width, each rounded up to a
    multiple of ``size_divisible``."""
    height = max(img.shape[-2] for img in images)
    width = max(img.shape[-1] for img in images)
    return (
        int(math.ceil(height / size_divisible) * size_divisible),
        int(math.ceil(width / size_divisible) * size_divisible),
    )


def smallest_bucket(size: Size, buckets: Sequence[Size]) -> Size | None:
    """The bucket of least area at least ``size`` in both dimensions (the first listed among
    equal areas), or None when none holds it."""
    holding = [b for b in buckets if b[0] >= size[0] and b[1] >= size[1]]
    return min(holding, key=lambda b: b[0] * b[1]) if holding else None


class BucketedTransform(GeneralizedRCNNTransform):
    """torchvision's transform (normalise, resize, batch) whose batch tensor is padded to the
    smallest size bucket that holds torchvision's own padded size; ``image_sizes``, what the
    heads read, keep each image's size. A batch no bucket holds is padded as torchvision pads it
    and, in training, counted in ``unbucketed`` (its size in ``last_unbucketed``)."""

    def __init__(self, transform: GeneralizedRCNNTransform, buckets: Sequence[Sequence[int]]):
        super().__init__(
            transform.min_size,
            transform.max_size,
            transform.image_mean,
            transform.image_std,
            size_divisible=transform.size_divisible,
            fixed_size=transform.fixed_size,
            _skip_resize=transform._skip_resize,
        )
        self.buckets: tuple[Size, ...] = tuple((int(h), int(w)) for h, w in buckets)
        uneven = [
            b for b in self.buckets if b[0] % self.size_divisible or b[1] % self.size_divisible
        ]
        if uneven:  # the FPN's levels and the anchors' strides assume whole multiples
            raise ValueError(f"size buckets {uneven} are not multiples of {self.size_divisible}")
        self.unbucketed = 0
        self.last_unbucketed: Size | None = None

    def batch_images(self, images: list[Tensor], size_divisible: int = 32) -> Tensor:
        """One zero-padded batch tensor of the smallest bucket holding the images (torchvision's
        own size when none does)."""
        if torchvision._is_tracing():  # ONNX export: torchvision's traced batching
            return super().batch_images(images, size_divisible)
        natural = padded_size(images, size_divisible)
        bucket = smallest_bucket(natural, self.buckets)
        if bucket is None:
            if self.training:
                self.unbucketed += 1
                self.last_unbucketed = natural
            bucket = natural
        channels = max(img.shape[0] for img in images)
        # the same zeros and copies as torchvision's batch_images: bit for bit its tensor when
        # the bucket is its size
        batch = images[0].new_full((len(images), channels, *bucket), 0)
        for slot, img in zip(batch, images, strict=True):
            slot[: img.shape[0], : img.shape[1], : img.shape[2]].copy_(img)
        return batch

    def extra_repr(self) -> str:
        """The buckets, in the module's repr."""
        return f"buckets={list(self.buckets)}"


def use_size_buckets(model: nn.Module, buckets: Sequence[Sequence[int]]) -> BucketedTransform:
    """Pad ``model``'s batches (a torchvision R-CNN's) to ``buckets`` from now on (in place), and
    give its RoI poolers the FPN's scales up front; the transform installed is returned."""
    transform = BucketedTransform(model.transform, buckets)
    model.transform = transform
    fix_pooler_scales(model.roi_heads)
    return transform


def fix_pooler_scales(roi_heads: nn.Module) -> None:
    """Set each RoI pooler's scales to its FPN levels' strides (map 'k' is ResNet stage k+1's,
    stride 2**(k+2)), the values torchvision infers from an unpadded first batch.

    torchvision infers them once, from the first batch: each map's height over the largest
    real image height, rounded to a power of 2, then keeps them for the run. A bucket more than
    1.41x the batch's images' height (a 400 px high panorama in an 800 px bucket) would round
    P2 to 1/2 instead of 1/4 and pool every RoI of the run from the wrong place.
    """
    for name in ("box_roi_pool", "mask_roi_pool", "keypoint_roi_pool"):
        pooler = getattr(roi_heads, name, None)
        if pooler is None:
            continue
        levels = [int(k) + 2 for k in pooler.featmap_names]
        pooler.scales = [2.0**-level for level in levels]
        pooler.map_levels = initLevelMapper(
            levels[0],
            levels[-1],
            canonical_scale=pooler.canonical_scale,
            canonical_level=pooler.canonical_level,
        )


def size_buckets(model: nn.Module) -> BucketedTransform | None:
    """The bucketed transform of ``model`` (a DDP wrapper or a compiled model included), or None."""
    for module in model.modules():
        if isinstance(module, BucketedTransform):
            return module
    return None
