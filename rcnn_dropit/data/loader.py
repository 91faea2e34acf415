"""Datasets and DataLoaders from the config: dataset paths, shapes generation, loaders."""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from rcnn_dropit.errors import UsageError, require_path

from ..distributed import rank_and_world_size
from .coco import CocoDetection
from .samplers import GroupedBatchSampler, ShardSampler, aspect_ratio_groups
from .shapes import make_shapes, shapes_info, split_paths
from .transforms import build_transforms

_SHAPES_DEFAULT_ROOT = "datasets/shapes"
_COCO_DEFAULT_ROOT = "datasets/coco"
_SHAPES_KEYS = ("num_train", "num_val", "image_size", "num_classes", "seed")


def _field(obj: Any, name: str, *default: Any) -> Any:
    """Attribute or mapping key (data.shapes may be a dataclass or a plain dict)."""
    if isinstance(obj, dict):
        return obj.get(name, default[0]) if default else obj[name]
    return getattr(obj, name, *default)


def _shapes_params(cfg: Any) -> dict:
    shapes = cfg.data.shapes
    params = {k: int(_field(shapes, k)) for k in _SHAPES_KEYS}
    params["first_class"] = int(_field(shapes, "first_class", 0))  # optional in plain dicts
    return params


def dataset_root(cfg: Any) -> Path:
    """cfg.data.root; for shapes an empty or COCO-default root means datasets/shapes."""
    root = cfg.data.root
    if cfg.data.dataset == "shapes" and root in ("", None, _COCO_DEFAULT_ROOT):
        root = _SHAPES_DEFAULT_ROOT
    return Path(root)


def dataset_paths(cfg: Any, split: str) -> tuple[Path, Path, str, str]:
    """(image folder, annotation file, their config keys) of 'train' or 'val'."""
    if split not in ("train", "val"):
        raise ValueError(f"split: '{split}' is not one of 'train', 'val'")
    root = dataset_root(cfg)
    if cfg.data.dataset == "shapes":
        # the layout make_shapes writes (COCO 2017's names); the COCO path keys do not apply
        return (*split_paths(root, split), "data.root", "data.root")
    images_key, ann_key = f"data.{split}_images", f"data.{split}_ann"
    return (
        root / getattr(cfg.data, f"{split}_images"),
        root / getattr(cfg.data, f"{split}_ann"),
        images_key,
        ann_key,
    )


def ensure_dataset(cfg: Any) -> None:
    """Make sure the configured dataset is on disk: generate shapes if missing, check COCO paths."""
    dataset = cfg.data.dataset
    if dataset == "shapes":
        _ensure_shapes(dataset_root(cfg), _shapes_params(cfg))
    elif dataset == "coco":
        root = dataset_root(cfg)
        require_path(root, "folder", "data.root: folder")
        for split in ("train", "val"):
            images, ann, images_key, ann_key = dataset_paths(cfg, split)
            require_path(images, "folder", f"{images_key}: folder")
            require_path(ann, "file", f"{ann_key}: annotation file")
    else:
        raise UsageError(f"data.dataset: '{dataset}' is not one of 'coco', 'shapes'")


def _ensure_shapes(root: Path, params: dict) -> None:
    """Generate into a temporary sibling folder and rename it, so no half dataset is ever seen."""
    marker = split_paths(root, "val")[1]
    if not marker.is_file():
        if root.exists() and any(root.iterdir()):
            raise UsageError(
                f"data.root: folder '{root}' exists but holds no shapes dataset "
                f"({marker.relative_to(root)}); remove it or choose another data.root"
            )
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
        try:
            make_shapes(tmp, **params)
            if root.exists():
                root.rmdir()  # empty folder
            os.rename(tmp, root)
        except OSError:
            # another process (e.g. another rank) finished first: use its copy
            if not marker.is_file():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    found = json.loads(marker.read_text()).get("info", {}).get("shapes", {})
    wanted = shapes_info(**params)
    if found != wanted:
        raise UsageError(
            f"data.root: shapes dataset in '{root}' was generated with {found}, but data.shapes "
            f"asks for {wanted}; delete the folder or choose another data.root"
        )


def build_dataset(cfg: Any, split: str, seed: int = 0, as_float: bool = True) -> CocoDetection:
    """Dataset of one split with its transforms (random flip for 'train' only); images are
    float in [0, 1], or uint8 with ``as_float=False`` (what the loaders yield)."""
    images, ann, images_key, ann_key = dataset_paths(cfg, split)
    train = split == "train"
    dataset = CocoDetection(
        images,
        ann,
        train=train,
        transforms=build_transforms(train, float(cfg.data.hflip_prob), as_float=as_float),
        skip_missing_images=bool(cfg.data.skip_missing_images),
        seed=seed,
        image_key=images_key,
        ann_key=ann_key,
    )
    check_num_classes(dataset, int(cfg.model.num_classes), f"{ann_key}: '{ann}'")
    return dataset


def check_num_classes(dataset: CocoDetection, num_classes: int, where: str) -> None:
    """A model with fewer outputs than the data set's categories + background would fail deep
    inside the loss with an IndexError; say which key to change instead."""
    if dataset.num_classes > num_classes:
        raise UsageError(
            f"model.num_classes: {num_classes} is too small for {where}, which has "
            f"{dataset.num_classes - 1} categories; "
            f"it must be at least {dataset.num_classes} (the categories plus background)"
        )


def collate(batch: list) -> tuple[list[torch.Tensor], list[dict]]:
    """Detection batches stay lists: images differ in size until the model pads them."""
    return [item[0] for item in batch], [item[1] for item in batch]


def _seed_worker(worker_id: int) -> None:
    # torch seeds each worker from the loader's generator; derive python/numpy from it as well
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def build_train_loader(
    cfg: Any, distributed: bool, seed: int = 0, device: torch.device | None = None
) -> DataLoader:
    """Shuffled, aspect-ratio grouped training batches of uint8 images (see images_to_device);
    see GroupedBatchSampler for resuming. Memory is pinned when `device` is a CUDA device.

    ``train_loader.batch_sampler`` has ``set_epoch(epoch)`` and ``set_start_batch(k)``.
    The data set must be on disk already: :func:`ensure_dataset` runs once, before (on rank 0).
    """
    dataset = build_dataset(cfg, "train", seed=seed, as_float=False)
    rank, world_size = rank_and_world_size(distributed)
    # one code path for 1 and N processes: shuffle depends only on (seed, epoch)
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=False
    )
    groups = aspect_ratio_groups(dataset.image_sizes, int(cfg.data.aspect_ratio_group_factor))
    batch_sampler = GroupedBatchSampler(
        sampler, groups, int(cfg.solver.batch_size), emit_epoch=True
    )
    # Workers live for the whole run: the loop starts a new pass every epoch, and respawning
    # workers (and re-forking the dataset) each time costs seconds on COCO.
    return _loader(
        dataset, batch_sampler, int(cfg.data.num_workers), seed + rank, device, persistent=True
    )


def build_val_loader(cfg: Any, distributed: bool, device: torch.device | None = None) -> DataLoader:
    """Every validation image exactly once over all ranks, in order, batch size 1, uint8 images
    (see images_to_device); memory is pinned when `device` is a CUDA device.

    Batch size 1 keeps results independent of the number of ranks (batching pads images).
    Its workers are not persistent: evaluation is rare, and idle workers would hold a copy of
    the validation index through all of training. The data set must be on disk already (see
    :func:`ensure_dataset`).
    """
    dataset = build_dataset(cfg, "val", as_float=False)
    rank, world_size = rank_and_world_size(distributed)
    sampler = ShardSampler(len(dataset), rank, world_size)
    batch_sampler = torch.utils.data.BatchSampler(sampler, batch_size=1, drop_last=False)
    return _loader(dataset, batch_sampler, int(cfg.data.num_workers), 0, device, persistent=False)


def _loader(
    dataset: CocoDetection,
    batch_sampler: Any,
    num_workers: int,
    seed: int,
    device: torch.device | None,
    persistent: bool,
) -> DataLoader:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        collate_fn=collate,
        worker_init_fn=_seed_worker,
        generator=generator,
        # Pinned host memory makes the non_blocking copies to the GPU truly asynchronous.
        pin_memory=device is not None and torch.device(device).type == "cuda",
        persistent_workers=persistent and num_workers > 0,
    )
