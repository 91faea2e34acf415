"""Data: COCO-format datasets, transforms, aspect-ratio batching, synthetic shapes."""

from .coco import CocoDetection, load_coco_json, mask_to_rle, segmentation_to_mask
from .loader import (
    build_dataset,
    build_train_loader,
    build_val_loader,
    collate,
    dataset_paths,
    ensure_dataset,
)
from .samplers import GroupedBatchSampler, ShardSampler, aspect_ratio_groups, shard_indices
from .shapes import CLASS_NAMES, make_shapes
from .transforms import build_transforms, hflip, images_to_device

__all__ = [
    "CLASS_NAMES",
    "CocoDetection",
    "GroupedBatchSampler",
    "ShardSampler",
    "aspect_ratio_groups",
    "build_dataset",
    "build_train_loader",
    "build_transforms",
    "build_val_loader",
    "collate",
    "dataset_paths",
    "ensure_dataset",
    "hflip",
    "images_to_device",
    "load_coco_json",
    "make_shapes",
    "mask_to_rle",
    "segmentation_to_mask",
    "shard_indices",
]
